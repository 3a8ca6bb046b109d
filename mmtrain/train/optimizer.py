"""The optimizer: AdamW over fp32 master copies of the parameter shards this rank owns in its ``GradBuckets``
(``mmtrain.parallel.grad_buckets``), then the updated weights all-gathered over the data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.parallel.grad_buckets import GradBuckets, Bucket
from mmtrain.train.fused_adamw import FusedAdamW


@dataclass
class _Piece:
    param: nn.Parameter
    owner: GradBuckets
    bucket: Bucket
    start: int  # buffer range of this piece (inside the owned range)
    end: int
    master: torch.Tensor  # fp32 copy of the piece, what AdamW updates


class MixedPrecisionAdamW:
    """AdamW over fp32 master copies of the parameter pieces this rank owns; model params may be bf16.

    Without the distributed optimizer a rank owns everything; with it, only its 1/dp shard of every bucket, so
    master weights and both Adam moments take 12/dp bytes per parameter instead of 12. With
    ``master_weights=False`` AdamW updates the parameter buffer in place in its own dtype (no copies).
    """

    def __init__(self, buckets: list[GradBuckets], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, master_weights: bool = True, lr_scale_of=None) -> None:
        """``buckets``: one ``GradBuckets`` per reduction group (dense params over dp×cp, experts over edp).
        ``lr_scale_of(param) -> float`` (optional) puts parameters in per-scale groups whose ``"lr_scale"`` the
        trainer multiplies the scheduled learning rate by (e.g. a VLM's projector at 10x)."""
        self.buckets = buckets
        self.master_weights = master_weights
        self.pieces: list[_Piece] = []
        for owner in buckets:
            for b in owner.buckets:
                own_start, own_end = owner.owned_range(b)
                for p in b.params:
                    s, e = max(p.buffer_offset, own_start), min(p.buffer_offset + p.numel(), own_end)
                    if s < e:
                        view = owner.param_values(b, s, e)
                        master = view.detach().float().clone() if master_weights else view
                        self.pieces.append(_Piece(p, owner, b, s, e, master))
        scale_of = lr_scale_of or (lambda p: 1.0)
        # groups from every parameter (not only the pieces owned here), so all data-parallel ranks agree on them
        scales = sorted({float(scale_of(p)) for owner in buckets for b in owner.buckets for p in b.params})
        groups = []
        for scale in scales:
            mine = [pc for pc in self.pieces if float(scale_of(pc.param)) == scale]
            groups += [{"params": [pc.master for pc in mine if pc.param.ndim >= 2], "weight_decay": weight_decay},
                       {"params": [pc.master for pc in mine if pc.param.ndim < 2], "weight_decay": 0.0}]
            if lr_scale_of is not None:
                groups[-2]["lr_scale"] = groups[-1]["lr_scale"] = scale
        # torch's fused kernel (CUDA and CPU): the only AdamW that skips an update on a device-side flag
        # (``found_inf``); called through our FusedAdamW, as torch.optim's AdamW imports torch._dynamo
        self.optimizer = FusedAdamW(groups, lr=lr, betas=betas, eps=eps)
        self._grad_divisor: torch.Tensor | None = None
        # Each piece's gradient and parameter values are views of buffers that live as long as their owners:
        # made once here, not per step (a VLM has ~530 pieces: a few ms of host time a step, which the GPU
        # waits for). The gradients stay attached to the masters for the fused kernel.
        self._piece_grads = [(pc, pc.owner.reduced_grad(pc.bucket, pc.start, pc.end)) for pc in self.pieces]
        for pc, grad in self._piece_grads:
            pc.master.grad = grad
        self._values = [pc.owner.param_values(pc.bucket, pc.start, pc.end) for pc in self.pieces]
        self._masters = [pc.master for pc in self.pieces]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def piece_grads(self) -> list[tuple[_Piece, torch.Tensor]]:
        """(piece, its reduced gradient: a view of its owner's buffer) for every piece."""
        return self._piece_grads

    def divide_grads_at_step(self, divisor: torch.Tensor, replace: bool = False) -> None:
        """Have the next ``step`` divide the gradients by ``divisor`` (a 0-dim device tensor: the loss-token
        count, the clip's ``max(1, norm / max_norm)``; several calls multiply, ``replace`` drops what an earlier
        call left, e.g. a step that failed before its update) inside the fused AdamW kernel, which also writes
        the divided values back to the gradients: one pass over them, where a separate in-place multiply first
        takes two, and no host sync to decide whether it is needed."""
        divisor = divisor.double()
        keep = not replace and self._grad_divisor is not None
        self._grad_divisor = self._grad_divisor * divisor if keep else divisor

    @property
    def grad_divisor(self) -> torch.Tensor | None:
        """What the next ``step`` divides the gradients by (float64, 0-dim), or None."""
        return self._grad_divisor

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> None:
        """AdamW on this rank's pieces, then the weights gathered over data-parallel ranks. ``skip``: a 0-dim
        device tensor, non-zero to leave weights, moments and the step count as they are (a non-finite step,
        decided on the device, so no host sync); the copies and gathers then move unchanged values. A divisor
        from ``divide_grads_at_step`` is applied (and forgotten) here."""
        divisor, self._grad_divisor = self._grad_divisor, None
        if divisor is not None:
            divisor = divisor.float()
        self.optimizer.step(grad_scale=divisor, found_inf=skip.float() if skip is not None else None)
        if self.master_weights and self.pieces:
            # one multi-tensor copy (fp32 -> the parameter dtype, rounded as copy_ rounds), not a launch a piece
            torch._foreach_copy_(self._values, self._masters)
        for owner in self.buckets:
            owner.gather_params()

    def gather_full_params(self) -> None:
        """Collective: every parameter whole on every rank (a no-op unless FP8 parameter gathers left some stale;
        ``GradBuckets.gather_full_params``). The checkpoint writer calls it before reading the weights."""
        for owner in self.buckets:
            owner.gather_full_params()

    def release_full_params(self) -> None:
        """After reading the whole weights (``gather_full_params``): each owner frees what it keeps only in use
        (fully sharded buckets: the units)."""
        for owner in self.buckets:
            owner.release_full_params()

    def params_loaded(self) -> None:
        """After a checkpoint load wrote whole parameter values (``gather_full_params`` first): each owner takes
        what it keeps from them (fully sharded buckets: this rank's shards)."""
        for owner in self.buckets:
            owner.params_loaded()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

