"""Models, written for one device; parallel plans wrap them (mmtrain.parallel).

Public (loaded lazily): ``GPTModel`` (Llama-family decoder, one device or one pipeline stage),
``VLMModel`` (vision/audio encoders + projector + the GPT language model), ``VisionEncoder``, ``AudioEncoder``,
``Projector``, ``count_parameters``, ``flops_per_token``; attention strategies a model is built with:
``CausalAttention`` (causal / document-masked), ``BidirectionalAttention`` (encoders), ``ContextParallelAttention``
(under CP).
Everything else in this package is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    # GPTModel (the Llama family's) and VLMModel (it composes a family) live in mmtrain/models/; these names
    # stay public here, loaded by name only: the shared blocks of this package import no family
    "GPTModel": "mmtrain.models.llama.model", "count_parameters": "mmtrain.models.llama.model",
    "flops_per_token": "mmtrain.models.llama.model",
    "VLMModel": "mmtrain.models.vlm", "VisionEncoder": "mmtrain.model.vision", "AudioEncoder": "mmtrain.model.audio",
    "Projector": "mmtrain.model.projector", "CausalAttention": "mmtrain.model.attention",
    "BidirectionalAttention": "mmtrain.model.attention", "ContextParallelAttention": "mmtrain.model.attention_cp",
}
__all__ = ["AudioEncoder", "BidirectionalAttention", "CausalAttention", "ContextParallelAttention",
           "GPTModel", "Projector", "VLMModel", "VisionEncoder", "count_parameters",
           "flops_per_token"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
