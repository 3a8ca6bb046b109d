"""Host-to-device copies that keep the host ahead of the GPU.

CUDA performs a copy from pageable host memory synchronously with the stream: the host waits until every queued
kernel has run before the copy starts. A training loop that copies each micro-batch's tokens (or a VLM batch's
images) straight from the loader's tensors therefore drains the GPU's queue every step, and the GPU then idles
while the host launches the next step's first kernels (and builds what the step needs first, such as a packed
batch's attention block mask). Staging the tensor in pinned memory first (one host memcpy, from PyTorch's caching
host allocator, which keeps the block until the copy has finished) makes the copy truly asynchronous.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device``, queued without waiting for the GPU (None stays None). A CPU tensor bound for a CUDA
    device goes through pinned memory unless it is pinned already; any other move is a plain non-blocking ``to``."""
    if t is None:
        return None
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        # not ``pin_memory()``: it refuses a tensor whose elements share memory (an expanded position row)
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)
