"""The Mamba-2 SSD chunked scan on the GPU: fla-core's simple-GLA Triton kernels behind ``ssd.py``'s signature.

Mamba-2's SSD recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = C_t h_t`` is simple gated linear
attention with a per-head scalar log-decay: fla's ``chunk_simple_gla`` (fla-core 0.6.0, ``fla/ops/simple_gla``)
with q = C, k = B (each group's B and C repeated for the group's heads), v = dt * x, g = dt * A and scale 1.

fla's conventions, read in its source (``fla/ops/simple_gla/chunk.py``, ``fla/ops/common/chunk_h.py``,
``chunk_o.py``) and checked by running its kernels under Triton's CPU interpreter against ``ssd.ssd_chunked_scan``
in fp32, outputs and gradients (tests/unit/test_ssd_triton.py, tests/triton_interpreter.py):
  - layout [batch, time, heads, dim] (BTHK); ``head_first`` is gone in 0.6 (passing it raises);
  - ``g`` is the per-step log-decay, natural log, NOT cumulative: fla takes the chunk-local cumulative sum itself
    (``chunk_local_cumsum``, pre-scaled by 1/ln 2 for exp2);
  - the state is K x V = N x P by default; ``state_v_first=True`` stores it V x K = P x N, which is this
    interface's (B, H, P, N): initial and final states pass through without a transpose;
  - ``scale`` defaults to K**-0.5 (attention's), so 1.0 is passed;
  - q, k and v meet in ``tl.dot`` and must share a dtype (x's here; fp32 inputs run as TF32 dots on NVIDIA, bf16
    as bf16 with fp32 accumulation, the per-chunk states stored in the input dtype); g is kept fp32; the final
    state comes back fp32; the output is cast back to q's dtype (x's);
  - ``chunk_size`` must be a power of 2; fla's kernels are tuned and tested at its default 64, which this
    wrapper always uses: the block decomposition is exact, so the reference's ``chunk_size`` changes rounding
    only, not the result;
  - its autograd Function has a backward for q, k, v, g and the initial state; gradients reach x, dt, A, B and
    C through the plain torch ops below (the group repeat sums B's and C's gradients over the group's heads).

Packed documents: a document start resets the state to zero. Instead of fla's ``cu_seqlens`` mode (rows flattened,
one sequence per document), whose setup reads the number of documents and chunks on the host (a device sync in
``chunk_fwd_h``'s ``split_offsets[-1].item()`` and in ``prepare_chunk_indices``) and gives every batch new shapes,
the reset is written into the decay: at a document start g is set to ``RESET_LOG_DECAY``, so exp(g + anything
<= 0) underflows to exactly 0.0 in fp32 and nothing crosses the boundary, in the forward pass and in every
backward kernel (fla masks its out-of-causal-order exp2 terms with ``tl.where``, so the large positive exponents
there are selected away, not multiplied). Rows keep their shape; there is no host sync. The start's own decay
multiplies a zero state in the recurrence, so dropping its gradient (``torch.where``) is the exact gradient.
Position 0 of a row never resets: the row starts from ``initial_state_BHPN`` (zero when None), which therefore
continues the row's first document, and ``final_state`` is the state after the row's last token.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

import torch

# Log-decay written at each document start: exp(-128) = 2^-184.7 is below fp32's smallest subnormal (2^-149),
# so the decay across a boundary is exactly zero. Mamba-2's own decays are <= 0 (dt >= 0, A < 0), so a sum that
# contains this term stays below it. Small enough in magnitude that fp32 still resolves the within-document decays
# the chunk-local cumulative sum adds to it (ulp(185) = 1.5e-5).
RESET_LOG_DECAY = -128.0

# fla's chunk length: the one its kernels are tuned and tested with.
FLA_CHUNK_SIZE = 64

# What the kernels compute in: at most fp32 (TF32 dots). float64, the CPU tests' exact comparisons, stays with the
# PyTorch reference (ssd.ssd_scan sends only these dtypes here).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch._dynamo.assume_constant_result
def fla_backward_trusted() -> bool:
    """Whether fla-core's backward kernels give correct results here. fla 0.6 refuses its gated backward
    (``chunk_bwd_dqkwg``) on Hopper with Triton >= 3.4, < 3.7.1 unless tilelang is installed (its issue #640);
    torch 2.11 ships Triton 3.6, so on an H100/H200 training takes mamba-ssm's kernels (``ssd_mamba``) or, without
    them, the PyTorch scan (compiled with the block), while decoding (no gradient) keeps these kernels
    (``ssd.scan_backend``). A constant while compiling: the answer cannot change."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return True
    import triton

    version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3])
    return version >= (3, 7, 1) or importlib.util.find_spec("tilelang") is not None


def ssd_chunked_scan_triton(
    x_BSHP: torch.Tensor,
    dt_BSH: torch.Tensor,
    A_H: torch.Tensor,
    B_BSGN: torch.Tensor,
    C_BSGN: torch.Tensor,
    chunk_size: int,
    doc_ids_BS: torch.Tensor | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan on CUDA tensors through fla-core's Triton kernels; same signature and result as
    ``mmtrain.models.nemotron_h.ssd.ssd_chunked_scan`` (see the module docstring for what differs: rounding,
    fla's chunk length). Returns ``(y_BSHP in x's dtype, final_state_BHPN in fp32)``."""
    check_scan_inputs(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size, doc_ids_BS, initial_state_BHPN)
    if x_BSHP.device.type != "cuda" or x_BSHP.dtype not in KERNEL_DTYPES:
        raise ValueError(f"ssd_chunked_scan_triton runs on CUDA tensors in fp32, bf16 or fp16, got x in "
                         f"{x_BSHP.dtype} on {x_BSHP.device}; use ssd.ssd_chunked_scan (the PyTorch reference)")
    return fla_scan(load_chunk_simple_gla(), x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, doc_ids_BS, initial_state_BHPN)


def load_chunk_simple_gla() -> Callable:
    """fla-core's ``chunk_simple_gla``, imported on first use (fla imports Triton and probes the GPU)."""
    return load_fla("fla.ops.simple_gla", "chunk_simple_gla", "the GPU SSD scan")


@torch.compiler.disable  # an import is no graph op: the compiled mixer runs it eagerly
def load_fla(module: str, name: str, user: str) -> Callable:
    """``module.name`` of fla-core, or a one-line ImportError saying what ``user`` needs."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as err:  # ImportError, or Triton failing to find its driver
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ImportError(f"{user} needs fla-core 0.6 (pip install fla-core==0.6.0): importing {module} failed: "
                          f"{type(err).__name__}: {first_line}") from None


def fla_scan(
    chunk_simple_gla: Callable,
    x_BSHP: torch.Tensor,
    dt_BSH: torch.Tensor,
    A_H: torch.Tensor,
    B_BSGN: torch.Tensor,
    C_BSGN: torch.Tensor,
    doc_ids_BS: torch.Tensor | None,
    initial_state_BHPN: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan as one ``chunk_simple_gla`` call (checked inputs; any device the kernel runs on)."""
    heads, groups = x_BSHP.shape[2], B_BSGN.shape[2]
    dtype = x_BSHP.dtype
    dt = dt_BSH.float()
    log_decay_BSH = dt * A_H.float()
    if doc_ids_BS is not None:
        starts_BS = torch.zeros_like(doc_ids_BS, dtype=torch.bool)
        starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
        log_decay_BSH = torch.where(starts_BS[..., None], RESET_LOG_DECAY, log_decay_BSH)
    v_BSHP = (x_BSHP.float() * dt[..., None]).to(dtype)
    k_BSHN = B_BSGN.to(dtype).repeat_interleave(heads // groups, dim=2)
    q_BSHN = C_BSGN.to(dtype).repeat_interleave(heads // groups, dim=2)
    y_BSHP, final_state_BHPN = chunk_simple_gla(
        q_BSHN, k_BSHN, v_BSHP, g=log_decay_BSH, scale=1.0,
        initial_state=initial_state_BHPN, output_final_state=True, state_v_first=True, chunk_size=FLA_CHUNK_SIZE)
    return y_BSHP.to(dtype), final_state_BHPN


def check_scan_inputs(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size, doc_ids_BS, initial_state_BHPN) -> None:
    """One-line ValueError naming the argument (of ``ssd_chunked_scan_triton`` or ``ssd_mamba.ssd_chunked_scan_mamba``)
    whose shape, dtype or device does not fit the others."""
    if x_BSHP.dim() != 4:
        raise ValueError(f"ssd scan: x must be (batch, seq, heads, head_dim), got shape {tuple(x_BSHP.shape)}")
    b, s, h, p = x_BSHP.shape
    if B_BSGN.dim() != 4 or B_BSGN.shape[:2] != (b, s):
        raise ValueError(f"ssd scan: B must be (batch={b}, seq={s}, groups, state), got shape {tuple(B_BSGN.shape)}")
    g, n = B_BSGN.shape[2], B_BSGN.shape[3]
    expected = {
        "dt": (dt_BSH, (b, s, h)), "A": (A_H, (h,)), "C": (C_BSGN, (b, s, g, n)),
        "doc_ids": (doc_ids_BS, (b, s)), "initial_state": (initial_state_BHPN, (b, h, p, n)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"ssd scan: {name} must have shape {shape} (from x {tuple(x_BSHP.shape)} and B "
                             f"{tuple(B_BSGN.shape)}), got {tuple(tensor.shape)}")
        if tensor is not None and tensor.device != x_BSHP.device:
            raise ValueError(f"ssd scan: {name} is on {tensor.device}, x on {x_BSHP.device}")
    if g < 1 or h % g:
        raise ValueError(f"ssd scan: heads ({h}) must be a multiple of B/C's groups ({g})")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd scan: chunk_size must be a positive int, got {chunk_size!r}")
    if doc_ids_BS is not None and (doc_ids_BS.is_floating_point() or doc_ids_BS.is_complex()):
        raise ValueError(f"ssd scan: doc_ids must be an integer tensor, got {doc_ids_BS.dtype}")
    for name, tensor in (("x", x_BSHP), ("dt", dt_BSH), ("A", A_H), ("B", B_BSGN), ("C", C_BSGN),
                         ("initial_state", initial_state_BHPN)):
        if tensor is not None and not tensor.is_floating_point():
            raise ValueError(f"ssd scan: {name} must be a floating-point tensor, got {tensor.dtype}")
