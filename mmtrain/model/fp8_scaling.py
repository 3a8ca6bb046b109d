"""FP8 scaling arithmetic shared by the native FP8 linear and its tests: formats, scales from amax, casts,
and the delayed-scaling amax history of a whole model.

Conventions: a *scale* ``s`` maps a high-precision tensor onto the FP8 range (``q = fp8(x * s)``); the
*inverse scale* ``1 / s`` is what ``torch._scaled_mm`` takes to undo it. ``s = fp8_max / amax / 2**margin``, so
the largest magnitude lands just under the format's largest finite value. Casts clamp first: PyTorch's
conversion to ``float8_e4m3fn`` turns out-of-range values into NaN, not into the largest value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def fp8_dtypes(fmt: str) -> tuple[torch.dtype, torch.dtype]:
    """(forward dtype for activations and weights, backward dtype for gradients) of an ``fp8.format``."""
    if fmt == "hybrid":
        return E4M3, E5M2
    if fmt == "e4m3":
        return E4M3, E4M3
    raise ValueError(f"unknown fp8 format {fmt!r} (hybrid or e4m3)")


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (no host sync)."""
    return x.detach().abs().amax().float()


def rows_then_amax(x2: torch.Tensor) -> torch.Tensor:
    """max |x| of a 2-D activation/gradient as a 0-d fp32 tensor, reduced per row first, then over the rows.
    Same value as ``tensor_amax``; the per-row reduction has the loop shape of the row-major cast and of row-wise
    producers (RMSNorm, SwiGLU), so Inductor computes it in their kernel instead of re-reading the tensor."""
    return x2.detach().abs().amax(dim=-1).amax().float()


def scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2**margin; 1.0 where amax is zero or not finite (an all-zero tensor casts exactly with
    any scale, and a NaN/Inf amax must not poison later steps)."""
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    scale = fp8_max / torch.where(ok, amax, torch.ones_like(amax)) / (2.0 ** margin)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x * scale)); ``scale`` broadcasts (0-d/1-element per tensor, (M, 1) or (1, N) per row/column)."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def quantize_rowwise(x: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each slice along ``dim`` by its own amax: returns (fp8 tensor, fp32 inverse scales with ``dim`` kept
    as size 1), e.g. ``dim=-1`` of an (M, K) matrix gives one scale per row, shape (M, 1)."""
    amax = x.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = scale_from_amax(amax, FP8_MAX[dtype])
    return quantize(x, scale, dtype), scale.reciprocal()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.float() * scale_inv


class AmaxHistory:
    """Delayed scaling for a list of FP8 matmuls, updated once per optimizer step (``update``).

    Each matmul owns three fp32 buffers that its (compiled) forward and backward read and write in place:
    ``scales`` (2,) = [input scale, gradient scale] used by the casts once ``delayed_ready`` (before the first
    update there is no history and casts use current amaxes), and ``amax_x`` / ``amax_g`` (1,), the largest
    magnitude seen this step (max over micro-batches). The history itself, (M, 2, L) for M matmuls,
    lives here and never enters a compiled graph. ``update``: one all-reduce (MAX) of this step's amaxes over
    each of ``groups``, history ring step, new scales from the max (or most recent) amax, amaxes zeroed.
    ``rows`` / ``restore``: the per-matmul state a checkpoint holds, and continuing from it.
    """

    def __init__(self, matmuls: list, history_len: int, algo: str, margin: int,
                 fwd_dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
        if algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be max or most_recent, got {algo!r}")
        self.matmuls = matmuls
        self.algo, self.margin = algo, margin
        self.fp8_max = torch.tensor([FP8_MAX[fwd_dtype], FP8_MAX[grad_dtype]])
        self.history_len = history_len
        self.history: torch.Tensor | None = None  # (M, 2, L), made on the buffers' device at the first update
        self.pos = 0  # ring-buffer slot of the most recent step

    @torch.no_grad()
    def update(self, groups: list = ()) -> None:
        if not self.matmuls:
            return
        amax_now = torch.cat([torch.cat([m.amax_x, m.amax_g]) for m in self.matmuls]).view(-1, 2)
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(amax_now, op=dist.ReduceOp.MAX, group=group)
        if self.history is None:
            self._allocate(amax_now.device)
        self.pos = (self.pos + 1) % self.history_len
        self.history[:, :, self.pos] = amax_now
        amax = self.history.amax(dim=-1) if self.algo == "max" else amax_now
        torch._foreach_copy_([m.scales for m in self.matmuls], list(self._scales(amax).unbind(0)))
        torch._foreach_zero_([t for m in self.matmuls for t in (m.amax_x, m.amax_g)])
        for m in self.matmuls:
            m.delayed_ready = True  # a Python flag: compiled graphs specialize on it (one recompile, first step)

    def _allocate(self, device: torch.device) -> None:
        self.history = torch.zeros(len(self.matmuls), 2, self.history_len, device=device)
        self.fp8_max = self.fp8_max.to(device)

    def _scales(self, amax: torch.Tensor) -> torch.Tensor:
        """(M, 2) scales of (M, 2) amaxes; 1 where an amax is 0 (never seen a non-zero value)."""
        scales = scale_from_amax(amax, 1.0, self.margin) * self.fp8_max
        return torch.where(amax > 0, scales, torch.ones_like(scales))

    def rows(self) -> list[torch.Tensor] | None:
        """Each matmul's history as (2, L), oldest step first and this step last (the ring unrolled, so it does
        not depend on ``pos``); None before the first update. What a checkpoint stores."""
        if self.history is None:
            return None
        return list(self.history.roll(-(self.pos + 1), dims=-1).unbind(0))

    @torch.no_grad()
    def restore(self, saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Continue from a checkpoint: ``saved[i] = (history (2, L') as ``rows`` gives it, scales (2,))`` for
        matmul i, which then uses those scales (``delayed_ready``). At L' = L this is exactly the saved state.
        Otherwise the newest min(L, L') steps are kept (zeros before them at L' < L) and the scales recomputed
        from them with this run's algo and margin; returns the indices of those resized ones. Matmuls not in
        ``saved`` keep an empty history (they start afresh: current amaxes until the next update)."""
        if not saved:
            return []
        device = self.matmuls[0].scales.device
        if self.history is None:
            self._allocate(device)
        else:  # unroll, so that the newest step is at the last slot for every row
            self.history = self.history.roll(-(self.pos + 1), dims=-1).contiguous()
        self.pos = self.history_len - 1
        resized = []
        for i, (row, scales) in saved.items():
            row = row.to(device=device, dtype=torch.float32)
            L = self.history_len
            m = self.matmuls[i]
            if row.shape[-1] == L:
                self.history[i] = row
                m.scales.copy_(scales)
            else:
                kept = row[:, -L:]
                self.history[i].zero_()
                self.history[i, :, L - kept.shape[-1]:] = kept
                amax = self.history[i].amax(dim=-1) if self.algo == "max" else self.history[i, :, -1]
                m.scales.copy_(self._scales(amax.view(1, 2)).view(2))
                resized.append(i)
            m.amax_x.zero_()
            m.amax_g.zero_()
            m.delayed_ready = True
        return resized
