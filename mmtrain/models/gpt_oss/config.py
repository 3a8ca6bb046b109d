"""The GPT-OSS family's shape: ``GptOssConfig`` (its fields, ``check``, ``check_layout``, ``lora_targets``).

The dataclass lives in ``mmtrain.config.gpt_oss_schema`` because a run config embeds it (``model.family:
gpt_oss``, the shape under ``model.gpt_oss``); it is re-exported here with the family's other names.
"""

from __future__ import annotations

from mmtrain.config.gpt_oss_schema import GPT_OSS_LORA_TARGETS, LAYER_TYPES, GptOssConfig

__all__ = ["GPT_OSS_LORA_TARGETS", "GptOssConfig", "LAYER_TYPES"]
