"""GPT-OSS family: attention sinks, sliding-window and full layers, YaRN RoPE, biased top-k MoE with a clamped
SwiGLU, MXFP4 expert weights dequantized at import (docs/model-families.md).

Public (loaded lazily): ``GptOssConfig`` (config.py), ``GptOssModel`` (model.py), ``config_from_hf`` /
``config_to_hf`` / ``state_dict_from_hf`` / ``state_dict_to_hf`` (hf_adapter.py), ``dequantize`` (mxfp4.py:
MXFP4 blocks and scales -> dense experts), ``gpt_oss_sharding_spec`` (spec.py), ``count_parameters`` /
``flops_per_token`` (family.py). A run selects it with ``model.family: gpt_oss``; TP/SP/PP/DP/EP come from its
sharding spec.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "GptOssConfig": "mmtrain.models.gpt_oss.config",
    "GptOssModel": "mmtrain.models.gpt_oss.model",
    "config_from_hf": "mmtrain.models.gpt_oss.hf_adapter",
    "config_to_hf": "mmtrain.models.gpt_oss.hf_adapter",
    "state_dict_from_hf": "mmtrain.models.gpt_oss.hf_adapter",
    "state_dict_to_hf": "mmtrain.models.gpt_oss.hf_adapter",
    "dequantize": "mmtrain.models.gpt_oss.mxfp4",
    "gpt_oss_sharding_spec": "mmtrain.models.gpt_oss.spec",
    "count_parameters": "mmtrain.models.gpt_oss.family",
    "flops_per_token": "mmtrain.models.gpt_oss.family",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
