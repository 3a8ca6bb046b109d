"""Knowledge distillation (``train.objective=distill``): the student learns the frozen teacher's next-token
distribution besides the labels, on the loop's data (pretraining text with packed documents, or SFT
conversations), layouts and checkpoints.

Per micro-batch, on the last pipeline stage, the teacher (``mmtrain.train.distill_teacher``: whole on the ranks
of that stage, sharded like the student over TP / CP / EP / FSDP) runs forward under ``no_grad`` on the
micro-batch's tokens, then the student's forward computes, in its output head (``DistillHead``), per token
``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE`` (``mmtrain.train.distill_loss``; the logits stay
split over the vocabulary under TP). The loss mask of the data (the documents' ends, SFT's assistant tokens)
weighs that sum exactly as it weighs the plain cross-entropy, so the KL counts only where the cross-entropy
counts, and the sum is divided by the global loss-token count like a token loss. Running the teacher whole where
the logits are keeps the pipeline schedule the student's own (the stages in between send the student's
activations only); the cost is the teacher's memory on the last stage.

The step line's ``loss`` is that objective; ``ce`` and ``kl`` are its two parts per loss token. The loop's
evaluation (``val_loss``) runs the student alone on the hard labels: the cross-entropy a plain run, the teacher
and ``mmtrain.evaluate`` report.
"""

from __future__ import annotations

import dataclasses

import torch

from mmtrain.config.schema import GPTRunConfig
from mmtrain.data.documents import GPTMicroBatch
from mmtrain.data.sft_dataset import sft_micro_batch
from mmtrain.models.registry import model_family
from mmtrain.parallel.context import shard_sequence
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.train.build import StageChunks
from mmtrain.train.distill_loss import DistillHead, KDSettings
from mmtrain.train.distill_teacher import build_teacher, read_teacher


def kd_settings(cfg: GPTRunConfig, mesh: ParallelMesh) -> KDSettings:
    """The distill section's numbers with this rank's vocabulary range (the TP plan's split of the head)."""
    d, tp = cfg.distill, mesh.dims.tp
    vocab = cfg.model.shape().vocab_size
    return KDSettings(d.temperature, d.alpha, d.top_k, mesh.tp_group if tp > 1 else None,
                      mesh.coord.tp * vocab // tp)


def student_head(stage: torch.nn.Module, kd: KDSettings) -> DistillHead | None:
    """Wrap the output head of the stage (its last virtual chunk) in a ``DistillHead``; None off the last stage."""
    chunks = stage.chunks if isinstance(stage, StageChunks) else [stage]
    if not chunks[-1].post_process:
        return None
    made: list[DistillHead] = []

    def wrap(head, vocab_size: int) -> DistillHead:
        made.append(DistillHead(head, kd))
        return made[0]

    chunks[-1].swap_head(wrap)
    return made[0]


def run_distill_micro_batches(stage, teacher, head: DistillHead | None, micro_batches: list, mesh: ParallelMesh,
                              cfg: GPTRunConfig, device: torch.device, buckets, schedule) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches through ``schedule`` (the loop's
    ``schedule_micro_batches``); returns [objective sum, loss tokens, cross-entropy sum, KL sum] (non-zero on the
    last stage)."""
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    cp, cp_rank = mesh.dims.cp, mesh.coord.cp
    micro = [b if isinstance(b, GPTMicroBatch) else sft_micro_batch(b) if b.ndim == 3 else GPTMicroBatch.plain(b)
             for b in micro_batches]

    def forward_step(i: int, received, module=stage):
        batch = micro[i].to(device)
        inputs, labels, positions, doc_ids, loss_mask = (
            None if t is None else shard_sequence(t, cp, cp_rank)  # this rank's context-parallel chunks
            for t in (batch.tokens[:, :-1], batch.tokens[:, 1:], batch.position_ids, batch.document_ids,
                      batch.loss_mask))
        if not module.post_process:
            return module(inputs if module.pre_process else received, None, positions, doc_ids)
        with torch.no_grad():
            teacher_logits = teacher(inputs, None, positions, doc_ids)
        with head.teaching(teacher_logits):
            out = module(inputs if module.pre_process else received, labels, positions, doc_ids)
        ce, kl = head.parts
        mask = torch.ones_like(out) if loss_mask is None else loss_mask
        total = (out * mask).sum()
        stats.add_(torch.stack([total.detach().double(), mask.sum().double(), (ce * mask).sum().double(),
                                (kl * mask).sum().double()]))
        return total

    mbs, S = micro[0].tokens.shape[0], micro[0].tokens.shape[1] - 1
    schedule(forward_step, len(micro), stage, mesh, cfg, device, buckets, (mbs, S, cfg.model.shape().hidden_size))
    return stats


def distill_metrics(stats: torch.Tensor, dt: float) -> dict:
    tokens = max(float(stats[1]), 1.0)
    return {"ce": float(stats[2]) / tokens, "kl": float(stats[3]) / tokens}


def distill_task(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device, stage: torch.nn.Module, lm,
                 param_dtype: torch.dtype, run_lm, schedule):
    """The loop's language-model ``StepTask`` ``lm`` turned into the distillation step: the teacher built (last
    stage), the student's head wrapped. ``run_lm`` / ``schedule``: the loop's ``run_micro_batches`` and
    ``schedule_micro_batches``. FLOPs: the student's forward and backward and the teacher's forward (a third of
    its training FLOPs) per token."""
    kd = kd_settings(cfg, mesh)
    checkpoint = read_teacher(cfg)
    teacher = build_teacher(cfg, checkpoint, mesh, device, param_dtype)
    head = student_head(stage, kd)
    per_token = [model_family(m).flops_per_token(m, cfg.data.seq_length) for m in (cfg.model, checkpoint.model)]
    flops = lm.step_flops(None) * (1 + per_token[1] / 3 / per_token[0])

    def forward_backward(micro: list, buckets) -> torch.Tensor:
        if buckets is None:  # the loop's evaluation: the student alone, its cross-entropy on the labels
            return run_lm(stage, micro, mesh, cfg, device, None)
        return run_distill_micro_batches(stage, teacher, head, micro, mesh, cfg, device, buckets, schedule)

    return dataclasses.replace(lm, forward_backward=forward_backward, step_flops=lambda stats: flops,
                               extra_metrics=distill_metrics)
