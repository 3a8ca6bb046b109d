"""A parameter's gradient written into its fp32 ``main_grad``: copied (the step's first) or added.

On CUDA, ``main_grad.add_(grad)`` / ``copy_(grad)`` with a BF16 ``grad`` run PyTorch's dtype-casting elementwise
path, which is not vectorised: on the H200 the 1B bench row's copy took 4.2 ms for 1.24e9 parameters (1.8 ms at
HBM speed) and the MoE row's accumulation 7.7 ms per micro-batch for 2.25e9 (5.4 ms). One Triton kernel reads
the BF16 gradient, converts, adds and stores in one vectorised pass. Results are bit-identical to the PyTorch
ops (fp32 conversion of a BF16 value is exact; the add is the same fp32 add). Elsewhere (CPU, equal dtypes,
non-contiguous tensors) the PyTorch ops run.
"""

from __future__ import annotations

import torch

_BLOCK = 4096
_kernel = None


def _triton_kernel():
    """The Triton kernel, compiled on first use (imported lazily: CPU runs never load Triton)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def accumulate_kernel(dst_ptr, src_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: buffers > 2**31
            inside = offsets < n
            value = tl.load(src_ptr + offsets, mask=inside).to(tl.float32)
            if ADD:
                value += tl.load(dst_ptr + offsets, mask=inside)
            tl.store(dst_ptr + offsets, value, mask=inside)

        _kernel = (accumulate_kernel, triton.cdiv)
    return _kernel


def launch(main_grad: torch.Tensor, grad: torch.Tensor, add: bool) -> None:
    """The kernel on two contiguous tensors of equal size (``main_grad`` fp32): ``main_grad (+)= grad``."""
    kernel, cdiv = _triton_kernel()
    n = main_grad.numel()
    kernel[(cdiv(n, _BLOCK),)](main_grad, grad, n, ADD=add, BLOCK=_BLOCK)


def write_grad(main_grad: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """``main_grad.copy_(grad)`` when ``first``, else ``main_grad.add_(grad)``; the Triton kernel where it applies."""
    if (main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype != torch.float32
            and main_grad.is_contiguous() and grad.is_contiguous() and grad.shape == main_grad.shape):
        launch(main_grad, grad, add=not first)
    elif first:
        main_grad.copy_(grad)
    else:
        main_grad.add_(grad)


def write_grads(writes: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    """Several ``write_grad(main_grad, grad, first)`` at once. The copies go in one multi-tensor copy (a few
    launches for a bucket's parameters, where each gradient took a launch from Python: 534 a step for the 2B VLM,
    whose H200 profile left ~14 ms of host time a step that the GPU waited for); CUDA's multi-tensor copy converts
    BF16 to fp32 in vectorised loads, exactly (every BF16 value is an fp32 value). The additions (later
    micro-batches) stay one kernel each."""
    copies = [(main_grad, grad) for main_grad, grad, first in writes if first]
    if copies:
        torch._foreach_copy_([main_grad for main_grad, _ in copies], [grad for _, grad in copies])
    for main_grad, grad, first in writes:
        if not first:
            write_grad(main_grad, grad, first=False)
