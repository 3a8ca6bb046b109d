"""Native FP8 linear on ``torch._scaled_mm``: y = x W^T with all three GEMMs (forward, dgrad, wgrad) in FP8.

``Fp8Matmul`` has the signature of ``F.linear(x, weight, bias)``, so it slots into any linear: our
``Fp8Linear`` (the single-device replacement of ``nn.Linear``, same parameter names) and the TP plan's
column/row-parallel linears (their ``matmul`` hook), which keep their own communication around it.

Layouts: ``_scaled_mm(a, b)`` wants ``a`` row-major and ``b`` column-major (the ".t() of a row-major tensor").
- forward  y[N,O]  = x[N,K] @ W^T: a = x_fp8, b = W_fp8.t() (free);
- dgrad   dx[N,K]  = g[N,O] @ W:   a = g_fp8, b = W^T_fp8.t() -> a transposed FP8 weight copy [K,O];
- wgrad   dW[O,K]  = g^T @ x:      a = g_fp8^T contiguous [O,N], b = (x_fp8^T contiguous [K,N]).t().
The two weight copies (W and W^T in FP8, with their scale) are made once per optimizer step outside the
compiled graph (``refresh_weight``) and reused by every micro-batch; scales are fp32 tensors, never host
numbers, so nothing syncs. Outputs are in the input dtype (bf16 in training).

Recipes: ``tensorwise`` scales each tensor by its current amax; ``delayed`` casts inputs and gradients with
scales from the amax history (``fp8_scaling.AmaxHistory``; the step's amaxes are recorded into buffers in
place, which torch.compile keeps in-graph; the first step, with no history yet, uses current amaxes), weights
always by their current amax (they are cast in a separate pass anyway); ``rowwise`` gives every row
of each GEMM operand its own scale along the contraction dimension (E4M3, bf16 out), casting x and g again
for the backward GEMMs (their contraction dimension differs), so it saves x in bf16.

On the CPU ``_scaled_mm`` handles per-tensor scales only; ``scaled_mm`` emulates the rest exactly as the GPU
defines it (dequantize, fp32 matmul), which is what the CPU tests exercise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.model.fp8_scaling import (
    E4M3,
    FP8_MAX,
    fp8_dtypes,
    quantize,
    quantize_rowwise,
    rows_then_amax,
    scale_from_amax,
    tensor_amax,
)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) in ``out_dtype``: ``torch._scaled_mm`` where it runs, else emulated."""
    if a.device.type == "cpu" and (a_inv.numel() > 1 or b_inv.numel() > 1):
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    a_inv, b_inv = (s.reshape(()) if s.numel() == 1 else s for s in (a_inv, b_inv))
    return torch._scaled_mm(a, b, a_inv, b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)


class _TensorwiseFp8Linear(torch.autograd.Function):
    """Per-tensor scaled FP8 GEMMs. ``x_scale`` / ``g_scale``: the delayed scales, or None to scale by the
    tensor's current amax; ``amax_g`` (delayed scaling) is raised in place to this micro-batch's gradient amax."""

    @staticmethod
    def forward(ctx, x2, weight, w_fp8, w_t_fp8, w_inv, x_scale, g_scale, amax_g, fwd_dtype, grad_dtype,
                bwd_fast_accum):
        if x_scale is None:
            x_scale = scale_from_amax(rows_then_amax(x2), FP8_MAX[fwd_dtype])
        x_fp8 = quantize(x2, x_scale, fwd_dtype)
        x_inv = x_scale.reciprocal().reshape(1)
        y = scaled_mm(x_fp8, w_fp8.t(), x_inv, w_inv, x2.dtype, fast_accum=True)
        ctx.save_for_backward(x_fp8, x_inv, w_t_fp8, w_inv, g_scale)
        # not saved: saved tensors are version-checked, and another micro-batch's backward may raise it first
        ctx.amax_g = amax_g
        ctx.grad_dtype, ctx.out_dtype, ctx.w_dtype = grad_dtype, x2.dtype, weight.dtype
        ctx.bwd_fast_accum = bwd_fast_accum
        return y

    @staticmethod
    def backward(ctx, g2):
        x_fp8, x_inv, w_t_fp8, w_inv, g_scale = ctx.saved_tensors
        amax_g = ctx.amax_g
        g2 = g2.contiguous()
        if amax_g is not None or g_scale is None:
            g_amax = rows_then_amax(g2)
            if amax_g is not None:
                amax_g.copy_(torch.maximum(amax_g, g_amax.reshape(1)))
            if g_scale is None:
                g_scale = scale_from_amax(g_amax, FP8_MAX[ctx.grad_dtype])
        g_fp8 = quantize(g2, g_scale, ctx.grad_dtype)
        g_inv = g_scale.reciprocal().reshape(1)
        fast = ctx.bwd_fast_accum
        dx = scaled_mm(g_fp8, w_t_fp8.t(), g_inv, w_inv, ctx.out_dtype, fast_accum=fast)
        dw = scaled_mm(g_fp8.t().contiguous(), x_fp8.t().contiguous().t(), g_inv, x_inv, ctx.w_dtype, fast_accum=fast)
        return dx, dw, None, None, None, None, None, None, None, None, None


class _RowwiseFp8Linear(torch.autograd.Function):
    """Row-wise scaled FP8 GEMMs (E4M3 operands, one scale per row/column along the contraction dim)."""

    @staticmethod
    def forward(ctx, x2, weight, w_row, w_row_inv, w_col_t, w_col_inv):
        xq, x_inv = quantize_rowwise(x2, -1, E4M3)  # per token, over K
        y = scaled_mm(xq, w_row.t(), x_inv, w_row_inv.t(), torch.bfloat16 if x2.is_cuda else x2.dtype)
        ctx.save_for_backward(x2, w_col_t, w_col_inv)
        ctx.w_dtype = weight.dtype
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, g2):
        x2, w_col_t, w_col_inv = ctx.saved_tensors
        out = torch.bfloat16 if g2.is_cuda else g2.dtype
        g2 = g2.contiguous()
        gq, g_inv = quantize_rowwise(g2, -1, E4M3)  # dgrad: per token, over O
        dx = scaled_mm(gq, w_col_t.t(), g_inv, w_col_inv, out).to(g2.dtype)
        gtq, gt_inv = quantize_rowwise(g2.t(), -1, E4M3)  # wgrad: per output feature, over tokens
        xtq, xt_inv = quantize_rowwise(x2.t(), -1, E4M3)  # per input feature, over tokens
        dw = scaled_mm(gtq.contiguous(), xtq.contiguous().t(), gt_inv, xt_inv.t(), out).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


@torch.compiler.disable
def _rowwise_eager(*args: torch.Tensor) -> torch.Tensor:
    """Row-wise FP8 runs eagerly: compiled, its GPU gradients came out wrong (tests/gpu/test_fp8_gpu.py, torch
    2.11), while the same function run eagerly matches BF16."""
    return _RowwiseFp8Linear.apply(*args)


def _cast_weight_pair(w: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """W and W^T (contiguous) in FP8 with one scale, and the inverse scale: one fused kernel when compiled."""
    scale = scale_from_amax(amax, FP8_MAX[dtype])
    a = quantize(w, scale, dtype)
    return a, a.t().contiguous(), scale.reciprocal().reshape(1)


def _weight_scales(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scales = scale_from_amax(amax.float(), FP8_MAX[dtype])
    return scales, scales.reciprocal()


class Fp8Casts:
    """The per-step FP8 weight casts, each compiled on the GPU at its first use (eager on the CPU): 64 linears x a
    few eager kernels would cost ~ms per step. One object per model: ``apply_native_fp8`` makes it and gives it to
    every matmul it makes; ``refresh_weights_in_place`` and the FP8 parameter gather use the matmuls' object. So
    the compiled graphs belong to their model (no module-global cache), and every cast of its weights goes
    through the same compiled function: the same bits (a compiled division need not round like an eager one)."""

    def __init__(self) -> None:
        self._compiled: dict = {}

    def run(self, fn, on_gpu: bool, *args):
        """``fn(*args)``: compiled on the GPU (once per function), eager on the CPU."""
        if not on_gpu:
            return fn(*args)
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn, dynamic=False)
        return self._compiled[fn](*args)

    def weight_pair(self, w: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        """FP8 W, W^T (contiguous) with one scale from ``amax``, and the inverse scale."""
        return self.run(_cast_weight_pair, w.is_cuda, w, amax, dtype)

    def weight_scales(self, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, inverse scales) of weights with amaxes ``amax`` (one per weight)."""
        return self.run(_weight_scales, amax.is_cuda, amax, dtype)


def _cast_weights_into(weights: list, scales: torch.Tensor, inv: torch.Tensor, a_bufs: list, b_bufs: list,
                       inv_bufs: list, dtype: torch.dtype) -> None:
    """Every weight's W and W^T in FP8 and its inverse scale, written into the existing buffers in place."""
    for i, w in enumerate(weights):
        q = quantize(w, scales[i], dtype)
        a_bufs[i].copy_(q)
        b_bufs[i].copy_(q.t())
        inv_bufs[i].copy_(inv[i].reshape(1))


@torch.no_grad()
def refresh_weights_in_place(matmuls: list, amax: torch.Tensor) -> bool:
    """Re-cast the FP8 weight copies of many per-tensor matmuls at once (``amax``: one per matmul) into the
    buffers they already have: on the GPU one compiled graph for all of them (one call instead of a call and
    four copies per weight, whose launches would otherwise leave the GPU waiting at the start of each step),
    from the first matmul's ``casts``. False, doing nothing, when a buffer is not sized yet (the first refresh)
    or the matmuls mix FP8 formats."""
    if not matmuls or len({m.fwd_dtype for m in matmuls}) > 1:
        return False
    weights = [m.weight_ref.detach() for m in matmuls]
    for m, w in zip(matmuls, weights):
        if (m.w_a.shape != w.shape or m.w_b.shape != w.t().shape or m.w_a.device != w.device
                or m.w_a_inv.numel() != 1):
            return False
    casts, dtype = matmuls[0].casts, matmuls[0].fwd_dtype
    casts.run(_cast_weights_into, weights[0].is_cuda, weights, *casts.weight_scales(amax, dtype),
              [m.w_a for m in matmuls], [m.w_b for m in matmuls], [m.w_a_inv for m in matmuls], dtype)
    torch._foreach_copy_([m.w_b_inv for m in matmuls], [m.w_a_inv for m in matmuls])
    for m in matmuls:
        m.weight_stale = False
    return True


class Fp8Matmul(nn.Module):
    """``F.linear`` in FP8 for one weight: the weight's cached FP8 copies and, for delayed scaling, the
    scale/amax buffers (all non-persistent: the state dict is the same as in BF16; checkpoints store delayed
    scaling's state by name through ``Fp8Runtime.delayed_state``). ``casts``: the model's ``Fp8Casts`` (its own
    when not given)."""

    def __init__(self, recipe: str = "tensorwise", fmt: str = "hybrid", fast_accum_backward: bool = False,
                 casts: Fp8Casts | None = None) -> None:
        super().__init__()
        self.casts = casts if casts is not None else Fp8Casts()
        if recipe not in ("tensorwise", "delayed", "rowwise"):
            raise ValueError(f"native fp8 recipe must be tensorwise, delayed or rowwise, got {recipe!r}")
        self.recipe = recipe
        self.fast_accum_backward = fast_accum_backward  # dgrad/wgrad with use_fast_accum (fp8.fast_accum_backward)
        self.fwd_dtype, self.grad_dtype = fp8_dtypes(fmt)
        self.weight_stale = True
        for name in ("w_a", "w_a_inv", "w_b", "w_b_inv"):  # FP8 weight copies, sized at the first refresh
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.delayed_ready = False  # set by AmaxHistory.update: until then delayed scaling uses current amaxes
        if recipe == "delayed":
            self.register_buffer("scales", torch.ones(2), persistent=False)
            self.register_buffer("amax_x", torch.zeros(1), persistent=False)
            self.register_buffer("amax_g", torch.zeros(1), persistent=False)

    def extra_repr(self) -> str:
        return (f"recipe={self.recipe}, fwd={self.fwd_dtype}, grad={self.grad_dtype}, "
                f"fast_accum_backward={self.fast_accum_backward}")

    @torch.no_grad()
    def refresh_weight(self, weight: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Cast the weight: rowwise -> W per row [O,K] and W^T per column [K,O]; else W and W^T with one scale,
        from ``amax`` when given (the runtime passes the amax of the whole weight, reduced over TP)."""
        w = weight.detach()
        if self.recipe == "rowwise":
            a, a_inv = quantize_rowwise(w, -1, E4M3)
            b, b_inv = quantize_rowwise(w.t(), -1, E4M3)  # [K, O]: per input feature k, over O
            b_inv = b_inv.t()  # (1, K)
            b = b.contiguous()
        else:
            a, b, a_inv = self.casts.weight_pair(w, tensor_amax(w) if amax is None else amax.float(), self.fwd_dtype)
            b_inv = a_inv
        for name, value in (("w_a", a), ("w_a_inv", a_inv), ("w_b", b), ("w_b_inv", b_inv)):
            buf = getattr(self, name)
            if buf.shape == value.shape and buf.dtype == value.dtype and buf.device == value.device:
                buf.copy_(value)  # same storage every step: compiled graphs keep their inputs
            else:
                setattr(self, name, value)
        self.weight_stale = False

    @torch.compiler.disable
    def _refresh_outside_graph(self, weight: torch.Tensor) -> None:
        self.refresh_weight(weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out_f, in_f = weight.shape
        x2 = x.reshape(-1, in_f)
        if x.is_cuda and (x2.shape[0] % 16 or in_f % 16 or out_f % 16):
            if getattr(self, "bf16_weight_partial", False):  # set by fp8_param_gather / fp8_fsdp: only FP8 W is whole
                raise RuntimeError(f"fp8.param_gather=true or parallel.fsdp=true: an FP8 linear got {x2.shape[0]} "
                                   "tokens, not a multiple of 16, and would fall back to BF16 weights that are not "
                                   "gathered; use batch shapes whose token count is a multiple of 16, or "
                                   "fp8.param_gather=false and parallel.fsdp=false")
            return F.linear(x, weight, bias)  # _scaled_mm needs every dimension a multiple of 16
        if self.weight_stale:  # only when called outside a GPTModel forward (whose pre-hook re-casts)
            self._refresh_outside_graph(weight)
        if self.recipe == "rowwise":
            y = _rowwise_eager(x2, weight, self.w_a, self.w_a_inv, self.w_b, self.w_b_inv)
        else:
            delayed = self.recipe == "delayed"
            record = delayed and self.training
            if record:
                with torch.no_grad():
                    self.amax_x.copy_(torch.maximum(self.amax_x, rows_then_amax(x2).reshape(1)))
            # known scales (delayed, after the first update) let the cast fuse with whatever produced x
            x_scale, g_scale = (self.scales[0], self.scales[1]) if delayed and self.delayed_ready else (None, None)
            y = _TensorwiseFp8Linear.apply(x2, weight, self.w_a, self.w_b, self.w_a_inv, x_scale, g_scale,
                                           self.amax_g if record else None, self.fwd_dtype, self.grad_dtype,
                                           self.fast_accum_backward)
        y = y.view(*x.shape[:-1], out_f)
        return y + bias if bias is not None else y


class Fp8Linear(nn.Module):
    """Drop-in for a single-device ``nn.Linear`` (same ``weight``/``bias`` parameters and names)."""

    def __init__(self, linear: nn.Linear, recipe: str, fmt: str, fast_accum_backward: bool = False,
                 casts: Fp8Casts | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "part_sizes"):
            self.part_sizes = linear.part_sizes
        self.matmul = Fp8Matmul(recipe, fmt, fast_accum_backward, casts).to(linear.weight.device)  # its amax/scale buffers beside the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)
