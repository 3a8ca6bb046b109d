"""The training step loop, optimizer, schedules, checkpoints and metrics.

Public (loaded lazily): ``build_gpt_stage`` / ``build_vlm_stage`` (this rank's model with every parallel plan),
``train_gpt`` / ``train_vlm`` (the whole loop), ``run_micro_batches`` (forward-backward schedule),
``reduce_loss_stats``, ``finalize_grads``, ``clip_grad_norm``, ``lr_at``, ``save_checkpoint``,
``load_checkpoint``, ``find_checkpoint``, ``CheckpointWriter``, ``load_model_weights_only``.
Everything else in this package is internal and may change.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "build_gpt_stage": "mmtrain.train.build", "build_vlm_stage": "mmtrain.train.build_vlm",
    "train_gpt": "mmtrain.train.loop", "train_vlm": "mmtrain.train.vlm_train",
    "run_micro_batches": "mmtrain.train.loop", "reduce_loss_stats": "mmtrain.train.loop",
    "finalize_grads": "mmtrain.train.grads", "clip_grad_norm": "mmtrain.train.grads", "lr_at": "mmtrain.train.lr",
    "save_checkpoint": "mmtrain.train.checkpoint", "load_checkpoint": "mmtrain.train.checkpoint",
    "find_checkpoint": "mmtrain.train.checkpoint", "CheckpointWriter": "mmtrain.train.checkpoint",
    "load_model_weights_only": "mmtrain.train.checkpoint_state",
}
__all__ = ["CheckpointWriter", "build_gpt_stage", "build_vlm_stage", "clip_grad_norm", "finalize_grads",
           "find_checkpoint", "load_checkpoint", "load_model_weights_only", "lr_at", "reduce_loss_stats",
           "run_micro_batches", "save_checkpoint", "train_gpt", "train_vlm"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
