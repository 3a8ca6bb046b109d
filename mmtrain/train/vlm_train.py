"""A VLM run on the shared step loop (``mmtrain.train.loop.train_model``): this rank's VLM, frozen components,
per-component learning rates, ``MediaBatch`` micro-batches (media and text rows mixed), and a step that also
counts images for images/s and for the vision encoder's FLOPs.

The loss is summed over loss tokens (``loss_mask``) and divided by the global loss-token count after the
data-parallel reduction, exactly as for the GPT, so DP and gradient accumulation equal one process.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.config.vlm_run_schema import VLMRunConfig, lr_scale_for, matches
from mmtrain.config.vlm_schema import VLMModelConfig
from mmtrain.models.llama.model import flops_per_token
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.train.checkpoint import find_checkpoint, is_weights_only
from mmtrain.train.loop import (
    StepTask,
    TrainResult,
    global_batch_size,
    schedule_micro_batches,
    train_model,
)
from mmtrain.train.resume_inputs import resolve_resume
from mmtrain.utils.log import get_logger


def vision_flops_per_image(m: VLMModelConfig) -> float:
    """Training FLOPs (forward + backward = 3x forward) of the ViT and image projector for one image (tile)."""
    v, pr = m.vision, m.projector
    P, d, L = v.num_patches, v.hidden_size, v.num_layers
    mlp = (3 if v.activation == "swiglu" else 2) * d * v.ffn_hidden_size
    per_patch = L * (4 * d * d + mlp) + 3 * v.patch_size ** 2 * d  # matmul weights a patch passes through
    attention = L * 2 * P * d  # QK^T and AV, bidirectional: 2 * P * d multiply-adds per patch per layer
    width = d * pr.pixel_shuffle ** 2
    hidden = pr.hidden_size or m.language.hidden_size
    dims = [width] + [hidden] * (pr.num_layers - 1) + [m.language.hidden_size]
    projector = sum(a * b for a, b in itertools.pairwise(dims)) * m.tokens_per_image
    return 6.0 * (P * (per_patch + attention) + projector)


def _load_stage_weights(init_from: str, mesh: ParallelMesh, model: torch.nn.Module, verify: bool = True) -> None:
    """The model weights of an earlier run's checkpoint (e.g. stage 1 for stage 2), saved at any layout."""
    from mmtrain.train.checkpoint import CheckpointError, _complete_in
    from mmtrain.utils.dcp_storage import DamagedFileError

    folder = _complete_in(Path(init_from))
    if folder is None:
        raise CheckpointError(f"init_from={init_from}: no complete checkpoint there (no complete.json or latest)")
    from mmtrain.train.checkpoint_state import load_model_weights_only

    try:  # any saved layout: DCP reads each rank's boxes of the global tensors
        load_model_weights_only(folder, mesh, model, verify)
    except DamagedFileError as exc:
        raise CheckpointError(f"init_from={init_from}: {exc.with_earlier_checkpoint('init_from')}") from None
    except ValueError as exc:
        raise CheckpointError(f"init_from={init_from}: {exc}") from exc
    get_logger("train").info(f"initialized the weights from {folder}; training starts at step 0")


def _load_parts(cfg: VLMRunConfig, mesh: ParallelMesh, model: torch.nn.Module) -> None:
    """``init.*``: the pretrained parts' weights into this rank's stage, the report in the log (rank 0)."""
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.convert.vlm_parts import load_vlm_parts, report_lines

    try:
        report = load_vlm_parts(model, cfg.model, cfg.init.sources(), mesh.coord.tp, mesh.dims.tp,
                                cfg.init.expect_unused, cfg.init.expect_missing)
    except ConvertError as exc:
        raise ConfigError(str(exc)) from None
    if mesh.rank == 0:
        for line in report_lines(report):
            get_logger("train").info(line)


def _freeze_and_scales(model: torch.nn.Module, cfg: VLMRunConfig):
    """Apply ``cfg.freeze`` (requires_grad=False) and return ``lr_scale_of(param)``; a prefix that names no
    parameter is a ``ConfigError``."""
    names = [n for n, _ in model.named_parameters()]
    for key, prefixes in (("freeze", cfg.freeze), ("lr_scale", list(cfg.lr_scale))):
        for prefix in prefixes if cfg.parallel.pp == 1 else ():  # a pipeline stage lacks some components
            absent_audio = prefix == "audio" and not cfg.model.audio.enabled  # e.g. a shared stage-1 freeze list
            if not absent_audio and not any(matches(n, prefix) for n in names):
                top = sorted({n.split(".", 1)[0] for n in names})
                raise ConfigError(f"{key}: {prefix!r} names no parameter of this model (its components: "
                                  f"{', '.join(top)}; e.g. language.layers.0)")
    for name, p in model.named_parameters():
        if any(matches(name, f) for f in cfg.freeze):
            p.requires_grad_(False)
    scale_by_id = {id(p): lr_scale_for(n, cfg.lr_scale) for n, p in model.named_parameters()}
    return (lambda p: scale_by_id[id(p)]) if cfg.lr_scale else None


def _run_vlm_micro_batches(model, micro_batches: list, mesh: ParallelMesh, cfg: VLMRunConfig, device: torch.device,
                          buckets) -> torch.Tensor:
    """Forward (and backward with ``buckets``) over ``MediaBatch`` micro-batches with the model's
    ``vlm_forward_step`` and the GPT's schedules; returns this rank's [sum of token losses, loss tokens, images]
    (losses on the last pipeline stage, images counted once: on the first stage's context-parallel rank 0)."""
    from mmtrain.train.build_vlm import vlm_forward_step

    stats = torch.zeros(3, device=device, dtype=torch.float64)
    count_images = mesh.coord.pp == 0 and mesh.coord.cp == 0

    def forward_step(i: int, received, module) -> torch.Tensor:
        out, total, count = vlm_forward_step(module, micro_batches[i], received, mesh, device)
        if count_images:
            stats[2] += micro_batches[i].num_images
        if total is not None:
            stats[0] += total.double()
            stats[1] += count.double()
        return out

    B, S = micro_batches[0].tokens.shape
    schedule_micro_batches(forward_step, len(micro_batches), model, mesh, cfg, device, buckets,
                           (B, S, cfg.model.language.hidden_size))
    return stats


def _vlm_task(cfg: VLMRunConfig, mesh: ParallelMesh, device: torch.device, model) -> StepTask:
    d = cfg.data
    lm_tok = flops_per_token(cfg.model.language, d.seq_length)
    tokens = global_batch_size(cfg, mesh.dims.dp) * d.seq_length
    per_image = vision_flops_per_image(cfg.model)
    return StepTask(
        forward_backward=lambda micro, buckets: _run_vlm_micro_batches(model, micro, mesh, cfg, device, buckets),
        step_flops=lambda stats: tokens * lm_tok + float(stats[2]) * per_image,
        extra_metrics=lambda stats, dt: {"images_per_s": float(stats[2]) / dt / mesh.dims.world_size},
        routed_experts=cfg.model.language.num_experts > 0)


def train_vlm(cfg: VLMRunConfig, mesh: ParallelMesh, device: torch.device) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps of the VLM on this rank."""
    from mmtrain.data.vlm_sources import build_vlm_batches
    from mmtrain.train.build_vlm import build_vlm_stage

    torch.manual_seed(cfg.train.seed)
    model = build_vlm_stage(cfg, mesh, device)
    lr_scale_of = _freeze_and_scales(model, cfg)
    found = find_checkpoint(cfg.checkpoint.load, cfg.logging.run_dir)
    if found is not None and is_weights_only(found):
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load}: a weights-only (converted) checkpoint is no "
                          "resume point (no optimizer or loader state); start from it with init_from (a whole VLM, "
                          "e.g. a converted LLaVA) or init.vision / init.language (its parts)")
    lr_schedule = resolve_resume(found, cfg, mesh.dims.dp)  # before the data is built: a changed order is an error
    if found is None and cfg.init_from:
        _load_stage_weights(cfg.init_from, mesh, model, cfg.checkpoint.verify)
    if found is None and cfg.init.sources():
        _load_parts(cfg, mesh, model)
    pin = device.type == "cuda"
    batches = build_vlm_batches(cfg, mesh, "train", pin)
    val_batches = build_vlm_batches(cfg, mesh, "valid", pin) if cfg.train.eval_every else None
    return train_model(cfg, mesh, device, model, batches, val_batches, _vlm_task(cfg, mesh, device, model), found,
                       model_name=cfg.model.name, lr_scale_of=lr_scale_of, lr_schedule=lr_schedule)
