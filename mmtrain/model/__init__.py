"""Models, written for one device; parallel plans wrap them (mmtrain.parallel).

Public (loaded lazily): ``GPTModel`` (Llama-family decoder, one device or one pipeline stage),
``VLMModel`` (vision/audio encoders + projector + the GPT language model), ``VisionEncoder``,
``AudioEncoder``, ``Projector``, ``count_parameters``, ``flops_per_token``.
Everything else in this package is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "GPTModel": "mmtrain.model.gpt", "count_parameters": "mmtrain.model.gpt", "flops_per_token": "mmtrain.model.gpt",
    "VLMModel": "mmtrain.model.vlm", "VisionEncoder": "mmtrain.model.vision", "AudioEncoder": "mmtrain.model.audio",
    "Projector": "mmtrain.model.projector",
}
__all__ = ["AudioEncoder", "GPTModel", "Projector", "VLMModel", "VisionEncoder", "count_parameters",
           "flops_per_token"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
