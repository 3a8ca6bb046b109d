"""DeepSeek-V3-style family: MLA attention, sigmoid-routed MoE with shared experts (docs/model-families.md).

Public (loaded lazily): ``DeepseekV3Config`` (config.py), ``load_deepseek_v3_config`` (shape_file.py),
``DeepseekV3Model`` (model.py), ``state_dict_from_hf`` / ``state_dict_to_hf`` / ``config_from_hf`` / ``config_to_hf``
(hf_adapter.py), ``SHARDING_SPEC`` / ``deepseek_v3_sharding_spec`` (spec.py),
``count_parameters`` / ``flops_per_token`` (flops.py).
A run selects it with ``model.family: deepseek_v3`` (``mmtrain.models.registry``); TP/SP/PP/DP/EP come from
its sharding spec.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "DeepseekV3Config": "mmtrain.models.deepseek_v3.config",
    "load_deepseek_v3_config": "mmtrain.models.deepseek_v3.shape_file",
    "DeepseekV3Model": "mmtrain.models.deepseek_v3.model",
    "state_dict_from_hf": "mmtrain.models.deepseek_v3.hf_adapter",
    "state_dict_to_hf": "mmtrain.models.deepseek_v3.hf_adapter",
    "config_from_hf": "mmtrain.models.deepseek_v3.hf_adapter",
    "config_to_hf": "mmtrain.models.deepseek_v3.hf_adapter",
    "SHARDING_SPEC": "mmtrain.models.deepseek_v3.spec",
    "deepseek_v3_sharding_spec": "mmtrain.models.deepseek_v3.spec",
    "count_parameters": "mmtrain.models.deepseek_v3.flops",
    "flops_per_token": "mmtrain.models.deepseek_v3.flops",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
