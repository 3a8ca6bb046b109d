"""The Llama family (Llama / Qwen2 / Mixtral shapes): the GPT the trainer runs (docs/model-families.md).

Public (loaded lazily): ``GPTModel``, ``count_parameters``, ``flops_per_token`` (model.py),
``llama_sharding_spec`` (spec.py). ``hf_adapter.py`` maps HF configs and state dicts (used by
``mmtrain.convert``).
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "GPTModel": "mmtrain.models.llama.model",
    "count_parameters": "mmtrain.models.llama.model",
    "flops_per_token": "mmtrain.models.llama.model",
    "llama_sharding_spec": "mmtrain.models.llama.spec",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
