"""Linear layers and SwiGLU MLPs for decoding a few tokens at a time: the bf16 decode kernel of ``mmtrain.model.gemv``.

At batch 1 a decode step multiplies one row by each weight matrix; that is bound by reading the weights, and
cuBLAS reads the 1B model's small matrices well below the H200's bandwidth (``bench/gemv.py``). ``GemvLinear``
sends a call of at most ``gemv.MAX_ROWS`` bf16 rows on a CUDA device, without autograd, to ``gemv.linear``;
``GemvMLP`` sends the fused [gate | up] projection of a SwiGLU MLP (``gemv.GATED_MAX_ROWS`` rows) to
``gemv.gated_linear``, whose epilogue is the activation (one kernel and no (rows, 2F) tensor in place of the
product and the activation's kernel). Every other call is ``nn.Linear``'s and ``MLP``'s own.

``use_decode_kernels`` turns the plain ``nn.Linear`` layers and gated ``MLP`` blocks of a model that is only
decoded (one prepared by ``mmtrain.inference.loading``) into these classes: the same parameters and state dict,
only ``forward`` differs (the model family's code calls them as before). Tensor-parallel linears (whose collectives
need their own forward), quantized linears (``mmtrain.model.quantized_linear``, their own kernels) and MLPs built
on them are left alone. Like cuBLAS's own choice of kernel by batch size, the kernel rounds a batch of one a
little differently from a larger batch (fp32 sums in another order); fp32 and the CPU are unaffected.
"""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.model.mlp import MLP


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, out_features: int, gated: bool = False) -> bool:
    """Whether a call of ``x`` on ``weight`` goes to the decode kernel (module docstring)."""
    if not x.is_cuda or x.dtype != weight.dtype or (torch.is_grad_enabled() and (x.requires_grad or
                                                                                 weight.requires_grad)):
        return False
    from mmtrain.model import gemv  # imports Triton: only on a GPU

    return gemv.supported(x.numel() // x.shape[-1], out_features, x.shape[-1], x.dtype, gated)


class GemvLinear(nn.Linear):
    """``nn.Linear`` whose few-row bf16 CUDA calls run ``gemv.linear`` (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _gemv_takes(x, self.weight, self.out_features):
            return super().forward(x)
        from mmtrain.model import gemv

        y = gemv.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class GemvMLP(MLP):
    """A SwiGLU ``MLP`` whose few-row bf16 CUDA calls run the gate|up product and the activation as one kernel
    (``gemv.gated_linear``), then ``down`` (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _gemv_takes(x, self.up.weight, self.up.out_features // 2, gated=True):
            return super().forward(x)
        from mmtrain.model import gemv

        h = gemv.gated_linear(x.reshape(-1, x.shape[-1]), self.up.weight, self.up.bias)
        return self.down(h.view(*x.shape[:-1], h.shape[-1]))


def use_decode_kernels(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``GemvLinear`` and every SwiGLU ``MLP`` of plain linears a
    ``GemvMLP``; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        if type(module) is MLP and module.activation == "swiglu" and type(module.up) in (nn.Linear, GemvLinear):
            module.__class__ = GemvMLP  # same parameters, buffers and state dict; only forward differs
            changed += 1
        elif type(module) is nn.Linear:
            module.__class__ = GemvLinear
            changed += 1
    return changed
