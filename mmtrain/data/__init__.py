"""Datasets and loaders: indexed token files, GPT samples, blends, multimodal (energon) loading.

Public (loaded lazily): ``IndexedDataset`` (Megatron ``.bin/.idx``), ``GPTSamples`` /
``build_gpt_samples_from_config`` (samples across documents, blends, splits), ``MockGPTSamples``,
``MicroBatches`` (per data-parallel rank, resumable), ``build_multimodal_loader`` / ``MultimodalLoader`` /
``MultimodalBatch`` / ``merge_loader_states`` (energon shards, slice order, resumable at any DP size).
Everything else in this package is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "IndexedDataset": "mmtrain.core.indexed", "GPTSamples": "mmtrain.data.gpt_dataset",
    "build_gpt_samples_from_config": "mmtrain.data.blend", "MockGPTSamples": "mmtrain.data.mock",
    "MicroBatches": "mmtrain.data.loader", "build_multimodal_loader": "mmtrain.data.multimodal_loader",
    "MultimodalLoader": "mmtrain.data.multimodal_loader", "merge_loader_states": "mmtrain.data.multimodal_loader",
    "MultimodalBatch": "mmtrain.data.multimodal",
}
__all__ = ["GPTSamples", "IndexedDataset", "MicroBatches", "MockGPTSamples", "MultimodalBatch", "MultimodalLoader",
           "build_gpt_samples_from_config", "build_multimodal_loader", "merge_loader_states"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
