"""mmtrain: from raw text, images, video and audio to a trained GPT or vision-language model on many GPUs.

The public API — everything a custom training loop needs — is importable from here (loaded lazily, so
``import mmtrain`` stays cheap and the prep tools never pay for torch):

Layout and processes
    ParallelDims, ParallelMesh, init_distributed, pick_device, shutdown_distributed
Configuration
    GPTRunConfig, ModelConfig, VLMRunConfig, VLMModelConfig, load_config, save_config, validate_gpt_config,
    validate_vlm_config, ConfigError
Models and parallel plans
    GPTModel, VLMModel, build_gpt_stage, build_vlm_stage, apply_tensor_parallel, apply_expert_parallel,
    expert_dispatch (the MoE layers' token dispatch, passed in at construction), CausalAttention,
    ContextParallelAttention (attention strategies a model is built with)
Forward-backward schedule
    run_micro_batches, reduce_loss_stats
Gradients and optimizer
    GradBuckets, MixedPrecisionAdamW, finalize_grads, clip_grad_norm, lr_at
Data
    MicroBatches, MockGPTSamples, GPTSamples, build_gpt_samples_from_config, IndexedDataset,
    build_multimodal_loader, MultimodalBatch
Checkpoints
    save_checkpoint, load_checkpoint, find_checkpoint, CheckpointWriter, load_model_weights_only
The whole loop
    train_gpt, train_vlm

Each subpackage (``mmtrain.core``, ``.config``, ``.parallel``, ``.model``, ``.data``, ``.train``, ``.convert``)
lists its own public names in ``__all__``. Anything not listed is internal and may change without notice; module-level helpers
used by one module only carry a leading underscore.
"""

from __future__ import annotations

from mmtrain.utils.lazy import lazy_exports

__version__ = "0.1.0"

_PUBLIC = {
    "ParallelDims": "mmtrain.parallel.dims", "ParallelMesh": "mmtrain.parallel.dims",
    "init_distributed": "mmtrain.parallel.launch", "pick_device": "mmtrain.parallel.launch",
    "shutdown_distributed": "mmtrain.parallel.launch",
    "GPTRunConfig": "mmtrain.config.schema", "ModelConfig": "mmtrain.config.schema",
    "load_config": "mmtrain.config.loader", "save_config": "mmtrain.config.loader",
    "ConfigError": "mmtrain.config.loader", "validate_gpt_config": "mmtrain.config.validate",
    "GPTModel": "mmtrain.models.llama.model", "build_gpt_stage": "mmtrain.train.build",
    "apply_tensor_parallel": "mmtrain.parallel.tensor", "CausalAttention": "mmtrain.model.attention",
    "ContextParallelAttention": "mmtrain.model.attention_cp",
    "apply_expert_parallel": "mmtrain.parallel.expert", "expert_dispatch": "mmtrain.parallel.expert",
    "run_micro_batches": "mmtrain.train.loop", "reduce_loss_stats": "mmtrain.train.loop",
    "GradBuckets": "mmtrain.parallel.grad_buckets", "MixedPrecisionAdamW": "mmtrain.train.optimizer",
    "finalize_grads": "mmtrain.train.grads", "clip_grad_norm": "mmtrain.train.grads", "lr_at": "mmtrain.train.lr",
    "MicroBatches": "mmtrain.data.loader", "MockGPTSamples": "mmtrain.data.mock",
    "GPTSamples": "mmtrain.data.gpt_dataset", "build_gpt_samples_from_config": "mmtrain.data.blend",
    "IndexedDataset": "mmtrain.core.indexed",
    "save_checkpoint": "mmtrain.train.checkpoint", "load_checkpoint": "mmtrain.train.checkpoint",
    "find_checkpoint": "mmtrain.train.checkpoint", "CheckpointWriter": "mmtrain.train.checkpoint",
    "train_gpt": "mmtrain.train.loop",
    "VLMRunConfig": "mmtrain.config.vlm_run_schema", "VLMModelConfig": "mmtrain.config.vlm_schema",
    "validate_vlm_config": "mmtrain.config.vlm_validate", "VLMModel": "mmtrain.models.vlm",
    "build_vlm_stage": "mmtrain.train.build_vlm", "build_multimodal_loader": "mmtrain.data.multimodal_loader",
    "MultimodalBatch": "mmtrain.data.multimodal", "load_model_weights_only": "mmtrain.train.checkpoint_state",
    "train_vlm": "mmtrain.train.vlm_train",
}

__all__ = ["CausalAttention", "CheckpointWriter", "ConfigError", "ContextParallelAttention", "GPTModel", "GPTRunConfig", "GPTSamples", "GradBuckets",
           "IndexedDataset", "MicroBatches", "MixedPrecisionAdamW", "MockGPTSamples", "ModelConfig",
           "MultimodalBatch", "ParallelDims", "ParallelMesh", "VLMModel", "VLMModelConfig", "VLMRunConfig",
           "apply_expert_parallel", "apply_tensor_parallel",
           "build_gpt_samples_from_config", "build_gpt_stage", "build_multimodal_loader", "build_vlm_stage",
           "clip_grad_norm", "expert_dispatch", "finalize_grads", "find_checkpoint", "init_distributed", "load_checkpoint",
           "load_config", "load_model_weights_only", "lr_at", "pick_device", "reduce_loss_stats",
           "run_micro_batches", "save_checkpoint", "save_config", "shutdown_distributed", "train_gpt", "train_vlm",
           "validate_gpt_config", "validate_vlm_config"]


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
