"""Data-parallel gradient reduction.

Gradients are reduced as *sums* and divided by the global number of loss tokens, so the result is exactly the
gradient of the mean loss over every token of the global batch, whatever the masks and the DP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def allreduce_grads(params: list[nn.Parameter], group, scale: float = 1.0) -> None:
    """Sum grads over ``group`` in one flat buffer per dtype, then multiply by ``scale``."""
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
