"""Weight quantization of one linear: round-to-nearest (the baseline) and GPTQ (Frantar et al., 2022), written here
in plain torch.

GPTQ quantizes a weight's input columns one after another and spreads each column's rounding error over the
columns not yet quantized, weighted by the inverse of the layer's input Hessian ``H = 2/n sum x x^T`` (from
calibration inputs), so that the layer's output on such inputs moves as little as possible. Rows are independent
given ``H``: a fused projection (our ``attn.qkv`` = HF's q|k|v, which share their input) quantized whole equals its
parts quantized one by one, so the export's split is exact. Groups of ``group_size`` columns share a scale,
computed (as compressed-tensors computes it) when GPTQ reaches the group, from the columns as the earlier errors
left them; blocks of columns are the groups (the lazy batch update of the paper, one block at a time).

Why GPTQ over AWQ: it changes nothing but the quantized weights (AWQ's per-channel scales must be folded into the
previous norm or linear, which the compressed-tensors W4A16 format has no place for and which differs per
family), and its errors are per row, so it needs no knowledge of how a family fuses its projections."""

from __future__ import annotations

import torch

from mmtrain.convert.compressed_tensors_format import QuantSpec, quantize_values, weight_scales

DAMPING = 0.01  # of the mean diagonal of H, added to it: keeps the Cholesky factorization defined


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """(values, scales) of ``weight`` (out, in) rounded to the nearest grid point: FP8 per output channel, or int4
    per group of ``spec.group_size`` (compressed-tensors' scales and rounding)."""
    scale = weight_scales(weight, spec, scale_dtype)
    return quantize_values(weight, scale, spec), scale


def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype,
                  damping: float = DAMPING) -> tuple[torch.Tensor, torch.Tensor]:
    """(int4 values, scales) of ``weight`` (out, in) by GPTQ with input Hessian ``hessian`` (in, in); computed in
    fp32 on the weight's device. Inputs that calibration never saw (a zero diagonal) are quantized to nearest."""
    if spec.scheme != "w4a16":
        raise ValueError("GPTQ is for int4 weights (w4a16); FP8 weights are rounded to nearest")
    w = weight.detach().float().clone()
    h = hessian.float().clone()
    out_features, in_features = w.shape
    group = spec.group_size
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damping * torch.diagonal(h).mean() * torch.eye(in_features, device=h.device)
    # the upper Cholesky factor of H^-1: row i holds what column i's error does to the columns after it
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    values = torch.empty((out_features, in_features), dtype=torch.int8, device=w.device)
    scales = torch.empty((out_features, in_features // group), dtype=scale_dtype, device=w.device)
    for start in range(0, in_features, group):
        end = start + group
        block = w[:, start:end].clone()
        scale = weight_scales(block, spec, scale_dtype)  # one group: (out, 1)
        scales[:, start // group] = scale[:, 0]
        s = scale.float()
        errors = torch.empty_like(block)
        h_block = hinv[start:end, start:end]
        for i in range(group):
            column = block[:, i]
            q = torch.clamp(torch.round(column / s[:, 0]), -8, 7)
            values[:, start + i] = q.to(torch.int8)
            err = (column - q * s[:, 0]) / h_block[i, i]
            block[:, i:] -= err.unsqueeze(1) * h_block[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, end:] -= errors @ hinv[start:end, end:]
    return values, scales
