"""The Nemotron-H hybrid family's registry record: ``FAMILY``, on its shape (``NemotronHConfig``,
``model.nemotron_h``)."""

from __future__ import annotations

import dataclasses

from mmtrain.models.family_record import ModelFamily, lazy, no_hf_adapter
from mmtrain.models.nemotron_h.flops import flops_per_token
from mmtrain.models.nemotron_h.model import NemotronHBlock, NemotronHModel

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
    hf=no_hf_adapter("nemotron_h"))
