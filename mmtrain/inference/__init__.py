"""Generation with a static KV cache, and the OpenAI-compatible server's pieces (docs/generate-serve.md).

Public (loaded lazily): ``DecodeEngine`` (slots of a static KV cache, one decode step for all of them;
continuous batching), ``Sequence`` (one prompt being completed), ``SamplingParams``, ``generate`` (prompts in,
completions out), ``decoder_forward`` (a model's cached forward: its family's ``decode``), ``StaticKVCache``, ``load_checkpoint_model`` (a checkpoint of any layout, this rank's TP
shard, a LoRA run's adapters merged, ready to decode), ``vlm_prompt_embeds`` (a VLM prompt with its media
spliced in). The command lines are ``python -m mmtrain.generate`` and ``python -m mmtrain.serve``. Everything
else here is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "DecodeEngine": "mmtrain.inference.engine", "Sequence": "mmtrain.inference.engine",
    "generate": "mmtrain.inference.engine", "SamplingParams": "mmtrain.inference.sampling",
    "decoder_forward": "mmtrain.inference.decoder", "StaticKVCache": "mmtrain.model.kv_cache",
    "load_checkpoint_model": "mmtrain.inference.loading", "vlm_prompt_embeds": "mmtrain.inference.vlm",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
