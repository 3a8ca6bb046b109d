"""The distillation loss per token, on logits that may be split over the vocabulary (tensor parallelism).

At temperature ``T`` the teacher's distribution is ``p = softmax(t / T)`` and the student's ``q = softmax(s / T)``;
the KD term is the forward KL ``KL(p || q) = sum_v p_v (log p_v - log q_v)``. With ``top_k = k > 0`` the teacher's
distribution is cut to its ``k`` largest logits ``K`` and renormalized there, ``p_v = exp(t_v / T) / sum_{u in K}
exp(t_u / T)`` for ``v`` in ``K`` and 0 elsewhere, while ``q`` stays the student's softmax over the whole vocabulary;
the term is the same sum over ``K`` (so ``k`` = the vocabulary size is the full KL, and the student is still pulled
to put its mass on ``K``). The run's loss per token is ``alpha * T^2 * KL + (1 - alpha) * CE`` (``T^2`` keeps the
KD gradients' scale independent of ``T``, as in Hinton et al. 2015).

Under TP each rank holds logits of its vocabulary range only (``vocab_start`` on); the maxima, sums of
exponentials and the KL's sums are all-reduced over the TP group, as the vocab-parallel cross-entropy does, and
the full vocabulary is never gathered (top-k: each rank's own top ``k`` candidates are gathered, ``k * TP`` per
token). ``DistillHead`` wraps the student's output head so the family's forward computes this loss where it
computes the cross-entropy; ``TeacherHead`` makes the teacher's forward return its logits as they are sharded.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class KDSettings:
    """The distill section's numbers and where this rank's logits sit in the vocabulary."""

    temperature: float
    alpha: float
    top_k: int
    group: object | None = None  # the TP group (None: the whole vocabulary is here)
    vocab_start: int = 0

    @property
    def sharded(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1


def _all_reduce(t: torch.Tensor, kd: KDSettings, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if kd.sharded:
        dist.all_reduce(t, op=op, group=kd.group)
    return t


@torch.no_grad()
def teacher_targets(teacher_NV: torch.Tensor, kd: KDSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of the teacher's distribution p (N, V_local) fp32, sum_v p_v log p_v (N,) over the whole
    vocabulary) from its logits (this rank's vocabulary range). Two (N, V_local) fp32 tensors at most."""
    t = teacher_NV.to(torch.float32, copy=True).div_(kd.temperature)
    if kd.top_k:
        return _top_k_targets(t, kd)
    m = _all_reduce(t.max(dim=-1).values, kd, dist.ReduceOp.MAX)
    t.sub_(m[:, None])
    exp = t.exp()
    sums = _all_reduce(torch.stack([exp.sum(dim=-1), torch.linalg.vecdot(exp, t)]), kd)
    del t
    z = sums[0]
    # sum p log p = sum p (t - m) - log z, with p = exp / z
    return exp.div_(z[:, None]), sums[1] / z - z.log()


def _top_k_targets(t: torch.Tensor, kd: KDSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k distribution: each rank's own k best, gathered over TP, the k best of those."""
    n_local = t.shape[-1]
    values, index = t.topk(min(kd.top_k, n_local), dim=-1)
    index = index + kd.vocab_start
    if kd.sharded:
        n = dist.get_world_size(kd.group)
        both = torch.stack([values, index.to(values.dtype)])  # ids below 2^24: exact in fp32
        gathered = torch.empty((n * 2, *both.shape[1:]), dtype=both.dtype, device=both.device)
        dist.all_gather_into_tensor(gathered, both.contiguous(), group=kd.group)
        gathered = gathered.view(n, *both.shape)
        values = gathered[:, 0].movedim(0, -2).flatten(-2)  # (N, n * k_local), rank by rank
        index = gathered[:, 1].movedim(0, -2).flatten(-2).long()
        values, pick = values.topk(min(kd.top_k, values.shape[-1]), dim=-1)
        index = index.gather(-1, pick)
    logp = values.log_softmax(dim=-1)
    p = logp.exp()
    local = index - kd.vocab_start
    inside = (local >= 0) & (local < n_local)
    dense = torch.zeros_like(t)  # p on this rank's range; zero where the teacher's top-k holds no token
    dense.scatter_add_(-1, local.clamp(0, n_local - 1), torch.where(inside, p, torch.zeros_like(p)))
    return dense, (p * logp).sum(dim=-1)


class _ShardedKL(torch.autograd.Function):
    """KL(p || softmax(s / T)) per row from the student's logits ``s`` (N, V_local) and the teacher's target ``p``
    (this rank's part) with its ``sum p log p``; the gradient ``(softmax(s / T) - p) / T`` is made in forward and
    kept (one (N, V_local) fp32 tensor, as the vocab-parallel cross-entropy keeps its softmax)."""

    @staticmethod
    def forward(ctx, s_NV, p_NV, p_log_p_N, kd):
        s = s_NV.to(torch.float32, copy=True).div_(kd.temperature)
        m = _all_reduce(s.max(dim=-1).values, kd, dist.ReduceOp.MAX)
        cross = torch.linalg.vecdot(p_NV, s)
        exp = s.sub_(m[:, None]).exp_()
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), cross]), kd)
        log_z = sums[0].log() + m
        ctx.save_for_backward(exp.div_(sums[0][:, None]).sub_(p_NV).div_(kd.temperature))
        ctx.input_dtype = s_NV.dtype
        return p_log_p_N - sums[1] + log_z  # sum_v p_v (log p_v - s_v / T + log z), sum_v p_v = 1

    @staticmethod
    def backward(ctx, grad_N):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_N[:, None]).to(ctx.input_dtype), None, None, None


def kd_token_kl(student_BSV: torch.Tensor, teacher_BSV: torch.Tensor, kd: KDSettings) -> torch.Tensor:
    """Per-token KL(teacher_T || student_T) (B, S) fp32, differentiable in the student's logits."""
    p, p_log_p = teacher_targets(teacher_BSV.flatten(0, 1), kd)
    return _ShardedKL.apply(student_BSV.flatten(0, 1), p, p_log_p, kd).view(student_BSV.shape[:2])


def distill_token_losses(ce_BS: torch.Tensor, kl_BS: torch.Tensor, kd: KDSettings) -> torch.Tensor:
    """``alpha * T^2 * KL + (1 - alpha) * CE`` per token (the cross-entropy left out at alpha = 1)."""
    kd_term = (kd.alpha * kd.temperature ** 2) * kl_BS
    return kd_term if kd.alpha == 1 else kd_term + (1 - kd.alpha) * ce_BS


class DistillHead(nn.Module):
    """The student's output head in a distillation run: the head it wraps (``LossHead``, or the TP plan's
    ``VocabParallelHead``) for everything, except that while ``teaching(teacher_logits)`` is active ``loss`` is
    the distillation loss per token and ``parts`` holds its (cross-entropy, KL) per token, detached. Outside
    (the loop's evaluation, samples) the head is the wrapped one: the cross-entropy."""

    def __init__(self, inner: nn.Module, kd: KDSettings) -> None:
        super().__init__()
        self.inner, self.kd = inner, kd
        self._teacher: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def matmul(self):
        return self.inner.matmul

    @contextmanager
    def teaching(self, teacher_logits: torch.Tensor) -> Iterator["DistillHead"]:
        """The student's forward inside computes the distillation loss against ``teacher_logits`` (this rank's
        vocabulary range, the same tokens)."""
        self._teacher, self.parts = teacher_logits, None
        try:
            yield self
        finally:
            self._teacher = None

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.prepare(x)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(x, weight)

    def loss(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        if self._teacher is None:
            return self.inner.loss(logits, labels_BS)
        if self.kd.alpha == 1:  # reported only: no graph, nothing kept for backward
            with torch.no_grad():
                ce = self.inner.loss(logits.detach(), labels_BS)
        else:
            ce = self.inner.loss(logits, labels_BS)
        kl = kd_token_kl(logits, self._teacher, self.kd)
        self.parts = (ce.detach(), kl.detach())
        return distill_token_losses(ce, kl, self.kd)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.inner.full_logits(logits)

    def compile_loss(self) -> None:
        self.inner.compile_loss()


class TeacherHead(nn.Module):
    """The teacher's output head: the wrapped head's, except that the logits a forward without labels returns
    stay as this rank holds them (its vocabulary range under TP), which is what the KL term reads."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def matmul(self):
        return self.inner.matmul

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.prepare(x)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(x, weight)

    def loss(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(logits, labels_BS)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def compile_loss(self) -> None:
        self.inner.compile_loss()
