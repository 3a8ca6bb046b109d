"""The DeepSeek-V3 family's registry record: ``FAMILY``, on its shape (``DeepseekV3Config``, ``model.deepseek_v3``)."""

from __future__ import annotations

import dataclasses

from mmtrain.models.deepseek_v3.flops import flops_per_token
from mmtrain.models.deepseek_v3.model import DecoderLayer, DeepseekV3Model
from mmtrain.models.family_record import HFAdapter, ModelFamily, lazy, lazy_values

_HF, _LORA = "mmtrain.models.deepseek_v3.hf_adapter", "mmtrain.models.deepseek_v3.lora_export"


def _architecture(cfg) -> dict:
    """Every shape field but naming, initialization and balancing."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("name", "init_std", "bias_update_rate")}


FAMILY = ModelFamily(
    stage_class=DeepseekV3Model, block_classes=(DecoderLayer,), flops_per_token=flops_per_token,
    has_routed_experts=lambda cfg: cfg.first_k_dense_replace < cfg.num_layers, architecture=_architecture,
    hf=HFAdapter(("deepseek_v3",), lazy(f"{_HF}:config_from_hf"), lazy(f"{_HF}:config_to_hf"),
                 lazy(f"{_HF}:state_dict_from_hf"), lazy(f"{_HF}:state_dict_to_hf"),
                 lazy_values(f"{_HF}:HFAdapterError"), lazy(f"{_LORA}:merge_lora"), lazy(f"{_LORA}:peft_adapter")))
