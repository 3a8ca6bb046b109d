"""The Gemma 3 family's registry record: ``FAMILY``, on its shape (``Gemma3Config``, ``model.gemma3``)."""

from __future__ import annotations

import dataclasses

from mmtrain.models.family_record import HFAdapter, ModelFamily, lazy, lazy_values
from mmtrain.models.gemma3.flops import flops_per_token
from mmtrain.models.gemma3.model import Gemma3Block, Gemma3Model

_HF, _LORA = "mmtrain.models.gemma3.hf_adapter", "mmtrain.models.gemma3.lora_export"


def _architecture(cfg) -> dict:
    """Every shape field but naming and initialization; layer kinds resolved (a pattern and the list it gives
    are the same architecture)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("name", "init_std",
                                                                          "sliding_window_pattern")}
    return {**fields, "layer_types": list(cfg.layer_kinds())}


FAMILY = ModelFamily(
    stage_class=Gemma3Model, block_classes=(Gemma3Block,), flops_per_token=flops_per_token,
    has_routed_experts=lambda cfg: False, architecture=_architecture,
    hf=HFAdapter(("gemma3_text",), lazy(f"{_HF}:config_from_hf"), lazy(f"{_HF}:config_to_hf"),
                 lazy(f"{_HF}:state_dict_from_hf"), lazy(f"{_HF}:state_dict_to_hf"),
                 lazy_values(f"{_HF}:HFAdapterError"), lazy(f"{_LORA}:merge_lora"), lazy(f"{_LORA}:peft_adapter")))
