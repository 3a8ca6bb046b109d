"""The Mamba-2 mixer's depthwise causal convolution on the GPU: fla-core's Triton ``causal_conv1d`` behind
``mixer.causal_conv``'s signature (x (B, S, C), weight (C, 1, K), bias (C,) or None, doc_ids (B, S) or None ->
(B, S, C) in x's dtype, fp32 math inside, a token's window confined to its own document).

fla's conventions, read in ``fla/modules/causal_conv1d/ops.py`` (fla-core 0.6.0) and checked under Triton's CPU
interpreter against ``mixer.causal_conv`` (tests/unit/test_ssd_triton.py): x is [batch, time, channels] (strided
views are read in place), the weight is [channels, width] with the last tap on the current token, math in fp32,
y stored in x's dtype; ``activation=None`` leaves the SiLU to the caller, as the mixer applies it; gradients for x,
weight and bias come from its autograd Function (the weight's and bias's reduced in fp32).

Documents go through fla's varlen mode: the rows are flattened to one sequence and ``cu_seqlens`` lists every
document start (each row's start among them). The document count sets that tensor's length, so it is read on the
host: ONE device-to-host copy per call (the (B*S,) start mask), which also hands fla the host copy
(``cu_seqlens_cpu``) its chunk index needs, so fla adds no sync of its own. Without documents there is none.
Unlike the scan (``ssd_triton.py``), a decay cannot carry the boundary: a tap either reaches the previous token or
not, which a plain convolution cannot express per position.
"""

from __future__ import annotations

from typing import Callable

import torch

from mmtrain.models.nemotron_h.ssd_triton import KERNEL_DTYPES, load_fla


def causal_conv_triton(x_BSC: torch.Tensor, weight_C1K: torch.Tensor, bias_C: torch.Tensor | None,
                       doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """``mixer.causal_conv`` on CUDA tensors through fla-core's Triton kernel (one host sync with documents)."""
    _check_conv_inputs(x_BSC, weight_C1K, bias_C, doc_ids_BS)
    if x_BSC.device.type != "cuda" or x_BSC.dtype not in KERNEL_DTYPES:
        raise ValueError(f"causal_conv_triton runs on CUDA tensors in fp32, bf16 or fp16, got x in {x_BSC.dtype} "
                         f"on {x_BSC.device}; use mixer.causal_conv (the PyTorch reference)")
    return fla_causal_conv(load_causal_conv1d(), x_BSC, weight_C1K, bias_C, doc_ids_BS)


def load_causal_conv1d() -> Callable:
    """fla-core's ``causal_conv1d``, imported on first use."""
    return load_fla("fla.modules.causal_conv1d", "causal_conv1d", "the GPU causal convolution")


def fla_causal_conv(causal_conv1d: Callable, x_BSC: torch.Tensor, weight_C1K: torch.Tensor,
                    bias_C: torch.Tensor | None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """The convolution as one ``causal_conv1d`` call (checked inputs; any device the kernel runs on)."""
    weight_CK = weight_C1K[:, 0, :]
    if doc_ids_BS is None:
        y, _ = causal_conv1d(x_BSC, weight=weight_CK, bias=bias_C, activation=None)
        return y
    batch, seq, channels = x_BSC.shape
    starts_BS = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    starts = starts_BS.flatten().cpu().nonzero().flatten()  # the host sync: the number of documents
    cu_seqlens_cpu = torch.cat([starts, torch.tensor([batch * seq])]).to(torch.int32)
    cu_seqlens = cu_seqlens_cpu.to(x_BSC.device, non_blocking=True)
    y, _ = causal_conv1d(x_BSC.reshape(1, batch * seq, channels), weight=weight_CK, bias=bias_C, activation=None,
                         cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return y.view(batch, seq, channels)


def _check_conv_inputs(x_BSC: torch.Tensor, weight_C1K: torch.Tensor, bias_C: torch.Tensor | None,
                       doc_ids_BS: torch.Tensor | None) -> None:
    """One-line ValueError naming the argument whose shape does not fit x's."""
    if x_BSC.dim() != 3:
        raise ValueError(f"causal conv: x must be (batch, seq, channels), got shape {tuple(x_BSC.shape)}")
    batch, seq, channels = x_BSC.shape
    if weight_C1K.dim() != 3 or weight_C1K.shape[:2] != (channels, 1):
        raise ValueError(f"causal conv: weight must be ({channels}, 1, kernel), got {tuple(weight_C1K.shape)}")
    if bias_C is not None and tuple(bias_C.shape) != (channels,):
        raise ValueError(f"causal conv: bias must be ({channels},), got {tuple(bias_C.shape)}")
    if doc_ids_BS is not None and tuple(doc_ids_BS.shape) != (batch, seq):
        raise ValueError(f"causal conv: doc_ids must be ({batch}, {seq}), got {tuple(doc_ids_BS.shape)}")
