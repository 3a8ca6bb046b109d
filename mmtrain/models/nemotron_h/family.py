"""The Nemotron-H hybrid family's registry record: ``FAMILY``, on its shape (``NemotronHConfig``,
``model.nemotron_h``)."""

from __future__ import annotations

import dataclasses

from mmtrain.models.family_record import HFAdapter, ModelFamily, lazy, lazy_values
from mmtrain.models.nemotron_h.flops import flops_per_token
from mmtrain.models.nemotron_h.model import NemotronHBlock, NemotronHModel

_HF, _LORA = "mmtrain.models.nemotron_h.hf_adapter", "mmtrain.models.nemotron_h.lora_export"
# what does not change what the weights compute: naming and initialization
_NOT_ARCHITECTURE = ("name", "initializer_range", "rescale_prenorm_residual", "time_step_min", "time_step_max",
                     "time_step_floor", "max_position_embeddings")


def _architecture(cfg) -> dict:
    """Every shape field that changes what the weights compute (initialization-only fields left out)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_ARCHITECTURE}


FAMILY = ModelFamily(
    stage_class=NemotronHModel, block_classes=(NemotronHBlock,), flops_per_token=flops_per_token,
    has_routed_experts=lambda cfg: False, architecture=_architecture,
    sharding_spec=lazy("mmtrain.models.nemotron_h.spec:nemotron_h_sharding_spec"),
    hf=HFAdapter(("nemotron_h",), lazy(f"{_HF}:config_from_hf"), lazy(f"{_HF}:config_to_hf"),
                 lazy(f"{_HF}:state_dict_from_hf"), lazy(f"{_HF}:state_dict_to_hf"),
                 lazy_values(f"{_HF}:HFAdapterError"), lazy(f"{_LORA}:merge_lora"), lazy(f"{_LORA}:peft_adapter")))
