"""Linear layers for decoding a few tokens at a time: the product split over the input features.

At batch 1 a decode step multiplies one row by each weight matrix; that is bound by reading the weights, and a
matrix with many more inputs than outputs (an MLP's down projection: 8192 -> 2048 in Llama-3.2-1B) gives cuBLAS
too few output tiles to keep every SM reading. Splitting the inputs into ``splits`` slices makes one batched
matmul of ``splits`` partial products (``splits`` times the thread blocks; no copy of the weight: each slice is
a strided view), summed in fp32. Measured on the H200 (``bench/decode_kernels.py``): 8 splits read the 1B
model's down projection at 3.5 TB/s against 3.0 for ``F.linear`` plus its split-K reduction kernel.

``use_split_k`` turns the eligible plain ``nn.Linear`` layers of a model that is only decoded (one prepared by
``mmtrain.inference.loading``) into ``SplitKLinear``: the same parameters and state dict. The split runs on a
CUDA device for at most ``MAX_ROWS`` rows without autograd (``bmm`` with an fp32 output has no backward); every
other call is ``nn.Linear``'s. Tensor-parallel linears (whose collectives need their own forward) are left alone.
Like cuBLAS's own choice of kernel by batch size, this rounds a bf16 batch-of-one a little differently from a
larger batch; fp32 on the CPU is unaffected.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_ROWS = 4  # tokens per call up to which the split pays (measured at batch 1)
MIN_SLICE = 1024  # input features per slice, at least: slices long enough to stream
MIN_FEATURES = 4096  # matrices narrower than this were not measured (the gain was at 8192 -> 2048)


def split_count(in_features: int, out_features: int) -> int:
    """How many slices to split ``in_features`` into (1: do not split): 8, 4 or 2 slices of at least
    ``MIN_SLICE`` features (a multiple of 8, for 16-byte-aligned bf16 rows), for a matrix of at least
    ``MIN_FEATURES`` inputs and at least twice as wide as it is tall."""
    if in_features < max(2 * out_features, MIN_FEATURES):
        return 1
    for s in (8, 4, 2):
        if in_features % s == 0 and in_features // s >= MIN_SLICE and (in_features // s) % 8 == 0:
            return s
    return 1


def split_k_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, splits: int) -> torch.Tensor:
    """``x_MK @ w_NK.T`` as ``splits`` partial products over slices of K, summed in fp32; (M, N) fp32."""
    (n, k), m = w_NK.shape, x_MK.shape[0]
    w = w_NK.view(n, splits, k // splits).permute(1, 2, 0)  # (s, k/s, n): slice i is w[:, i*k/s:(i+1)*k/s].T
    x = x_MK.reshape(m, splits, k // splits).transpose(0, 1)  # (s, m, k/s)
    # fp32 partials (cuBLAS accumulates in fp32 anyway): one rounding at the end, as F.linear's
    partial = torch.bmm(x, w, out_dtype=torch.float32) if x.dtype != torch.float32 else torch.bmm(x, w)
    return partial.sum(0)


class SplitKLinear(nn.Linear):
    """``nn.Linear`` whose few-row CUDA products are split over the input features (module docstring)."""

    splits: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (self.splits == 1 or not x.is_cuda or rows > MAX_ROWS or x.dtype != self.weight.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):  # no bmm backward
            return super().forward(x)
        y = split_k_matmul(x.reshape(rows, x.shape[-1]), self.weight, self.splits)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def use_split_k(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` that ``split_count`` splits a ``SplitKLinear``; returns how many."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and (s := split_count(module.in_features, module.out_features)) > 1:
            module.__class__ = SplitKLinear  # same parameters, buffers and state dict; only forward differs
            module.splits = s
            changed += 1
    return changed
