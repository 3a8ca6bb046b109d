"""Gemma 3 text family: local sliding-window and global layers, q/k norm, (1 + w) RMSNorms, GeGLU, the embedding
scaled by sqrt(hidden_size) (docs/model-families.md).

Public (loaded lazily): ``Gemma3Config`` (config.py), ``Gemma3Model`` (model.py), ``config_from_hf`` /
``config_to_hf`` / ``state_dict_from_hf`` / ``state_dict_to_hf`` (hf_adapter.py), ``gemma3_sharding_spec``
(spec.py), ``count_parameters`` / ``flops_per_token`` (flops.py). A run selects it with ``model.family: gemma3``
(the shape under ``model.gemma3``); TP/SP/PP/DP come from its sharding spec.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "Gemma3Config": "mmtrain.models.gemma3.config",
    "Gemma3Model": "mmtrain.models.gemma3.model",
    "config_from_hf": "mmtrain.models.gemma3.hf_adapter",
    "config_to_hf": "mmtrain.models.gemma3.hf_adapter",
    "state_dict_from_hf": "mmtrain.models.gemma3.hf_adapter",
    "state_dict_to_hf": "mmtrain.models.gemma3.hf_adapter",
    "gemma3_sharding_spec": "mmtrain.models.gemma3.spec",
    "count_parameters": "mmtrain.models.gemma3.flops",
    "flops_per_token": "mmtrain.models.gemma3.flops",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
