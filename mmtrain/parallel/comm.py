"""Autograd-aware collectives for tensor and sequence parallelism (Megatron's f/g operators and friends).

Each is a pair (forward op, backward op) over an explicit process group:

======================  ======================  =====================  ===============================
function                forward                 backward               used
======================  ======================  =====================  ===============================
copy_to_group           identity                all-reduce             input of a column-parallel linear
reduce_from_group       all-reduce              identity               output of a row-parallel linear
gather_seq              all-gather along dim    reduce-scatter         SP: input of a column-parallel linear
reduce_scatter_seq      reduce-scatter on dim   all-gather             SP: output of a row-parallel linear
split_seq               keep own chunk of dim   all-gather             SP: enter the sequence-sharded region
gather_seq_no_reduce    all-gather along dim    keep own chunk         SP: leave it (e.g. before the loss)
======================  ======================  =====================  ===============================
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if _size(group) > 1:
        x = x.clone(memory_format=torch.contiguous_format)  # never reduce in place into a tensor autograd saved
        dist.all_reduce(x, group=group)
    return x


def _identity(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x


class _Collective(torch.autograd.Function):
    """``forward_op`` in forward and ``backward_op`` on the gradient; both take (tensor, dim, group)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, dim, group):
        ctx.backward_op, ctx.dim, ctx.group = backward_op, dim, group
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _Collective.apply(x, _identity, _all_reduce, 0, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _Collective.apply(x, _all_reduce, _identity, 0, group)


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _Collective.apply(x, _all_gather, _reduce_scatter, dim, group)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _Collective.apply(x, _reduce_scatter, _all_gather, dim, group)


def split_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _Collective.apply(x, _split, _all_gather, dim, group)


def gather_seq_no_reduce(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _Collective.apply(x, _all_gather, _split, dim, group)
