"""Nemotron-H hybrid family: Mamba-2 (SSD) mixers, attention without positional embeddings and relu^2 MLPs,
one per layer as ``hybrid_override_pattern`` spells them (docs/model-families.md).

Public (loaded lazily): ``NemotronHConfig`` (config.py), ``NemotronHModel`` (model.py), ``Mamba2Mixer``
(mixer.py), ``ssd_chunked_scan`` / ``ssd_step`` / ``ssd_scan`` (ssd.py: the state-space scan in PyTorch),
``nemotron_h_sharding_spec`` (spec.py), ``count_parameters`` / ``flops_per_token`` (flops.py). A run selects it
with ``model.family: nemotron_h`` (the shape under ``model.nemotron_h``); TP/SP/PP/DP/FSDP come from its sharding
spec; context parallelism is refused.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "NemotronHConfig": "mmtrain.models.nemotron_h.config",
    "NemotronHModel": "mmtrain.models.nemotron_h.model",
    "Mamba2Mixer": "mmtrain.models.nemotron_h.mixer",
    "ssd_chunked_scan": "mmtrain.models.nemotron_h.ssd",
    "ssd_step": "mmtrain.models.nemotron_h.ssd",
    "ssd_scan": "mmtrain.models.nemotron_h.ssd",
    "nemotron_h_sharding_spec": "mmtrain.models.nemotron_h.spec",
    "count_parameters": "mmtrain.models.nemotron_h.flops",
    "flops_per_token": "mmtrain.models.nemotron_h.flops",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
