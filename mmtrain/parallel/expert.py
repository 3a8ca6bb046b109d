"""Expert parallelism: each rank of the ``ep`` group holds ``num_experts / ep`` experts; tokens travel to
their experts and back with all-to-all.

Dispatch for one MoE layer (dropless by default):
1. permute: sort this rank's (token, k) assignments by global expert id;
2. exchange counts (all-to-all of a (ep, local experts) count matrix), then the tokens themselves with variable
   splits; the received tokens arrive grouped by source rank, then by expert — re-sort them by local expert;
3. run the local experts (one grouped GEMM), undo the re-sort, all-to-all back, unpermute, weight and sum.

Expert weights are replicated over the ``edp`` group (the ranks holding the same experts), so their gradients
are reduced there, not over all data-parallel ranks (``GradBuckets`` per group, see ``mmtrain.train.loop``).
Experts are not split over tensor parallelism (Megatron's expert-TP = 1): with TP the MoE input is replicated
(or, with sequence parallelism, sequence-sharded, and then expert/router gradients are summed over TP).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def permute_by_expert(ids_NK: torch.Tensor, num_experts: int, keep_NK: torch.Tensor | None = None):
    """Order of the (token, k) assignments sorted by expert (dropped ones last) and tokens per expert (E + 1,);
    ``order[:kept] // K`` are the token rows to gather."""
    flat_ids = ids_NK.flatten()
    if keep_NK is not None:  # dropped assignments go to a virtual expert past the end and are zeroed
        flat_ids = torch.where(keep_NK.flatten(), flat_ids, num_experts)
    return flat_ids.argsort(stable=True), torch.bincount(flat_ids, minlength=num_experts + 1)


def unpermute_and_combine(y_sorted: torch.Tensor, order: torch.Tensor, weights_NK: torch.Tensor,
                          like_ND: torch.Tensor) -> torch.Tensor:
    """Scatter expert outputs back to their (token, k) slots and sum them with the routing weights."""
    N, K = weights_NK.shape
    y = like_ND.new_zeros(N * K, like_ND.shape[-1]).index_copy(0, order[:len(y_sorted)], y_sorted.to(like_ND.dtype))
    return (y.view(N, K, -1) * weights_NK[..., None].to(y.dtype)).sum(dim=1)


def _ep_dispatch(x_ND, weights_NK, ids_NK, experts, num_experts, keep_NK=None, *, group):
    ep = dist.get_world_size(group)
    local = num_experts // ep
    order, counts = permute_by_expert(ids_NK, num_experts, keep_NK)
    kept = int(counts[:num_experts].sum())
    send_counts = counts[:num_experts].view(ep, local)  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # [source rank, my local expert]
    send_splits = send_counts.sum(dim=1).tolist()
    recv_splits = recv_counts.sum(dim=1).tolist()
    x_recv = all_to_all(x_ND[order[:kept] // ids_NK.shape[1]], recv_splits, send_splits, group)
    # received: grouped by source rank, then local expert -> regroup by local expert, then source rank
    rc = recv_counts.tolist()
    starts, pos = [], 0
    for src in range(ep):
        row = []
        for e in range(local):
            row.append(pos)
            pos += rc[src][e]
        starts.append(row)
    regroup = [torch.arange(starts[src][e], starts[src][e] + rc[src][e]) for e in range(local) for src in range(ep)]
    regroup = torch.cat(regroup).to(x_ND.device) if regroup else torch.zeros(0, dtype=torch.long, device=x_ND.device)
    per_expert = recv_counts.sum(dim=0).tolist()
    y_local = experts(x_recv[regroup], per_expert)
    y_recv = torch.empty_like(y_local).index_copy(0, regroup, y_local) if len(regroup) else y_local
    y_sorted = all_to_all(y_recv, send_splits, recv_splits, group)
    return unpermute_and_combine(y_sorted, order, weights_NK, x_ND)


def apply_expert_parallel(model: nn.Module, group, token_groups: list = ()) -> nn.Module:
    """Keep this rank's slice of every MoE layer's experts and route tokens over ``group`` (all-to-all). Which
    group reduces the expert gradients (``edp``), and that they are partial over TP under sequence parallelism,
    is the model's sharding spec's business (``mmtrain.train.grads``). ``token_groups``:
    the groups a micro-batch's tokens are split over (TP under sequence parallelism, CP) for the balance loss."""
    ep = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if ep > 1 else 0
    spec = model.sharding_spec()
    for name, full in list(model.named_parameters()):  # every tensor the spec slices over EP
        dim = spec[name].expert_dim
        if dim is None:
            continue
        if full.shape[dim] % ep:
            raise ValueError(f"{name}: {full.shape[dim]} experts cannot be split over parallel.ep={ep} "
                             "(model.num_experts must be divisible by parallel.ep)")
        local = full.shape[dim] // ep
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nn.Parameter(full.data.narrow(dim, rank * local, local).clone()))
    for module in model.modules():
        if not getattr(module, "is_moe_layer", False):
            continue
        module.token_groups = [g for g in token_groups if g is not None and dist.get_world_size(g) > 1]
        if ep > 1:
            module.dispatch = partial(_ep_dispatch, group=group)
    return model


@torch.no_grad()
def update_router_biases(model: nn.Module, groups: list) -> dict[str, torch.Tensor]:
    """After a step: sum each MoE layer's expert load over ``groups`` (ranks that saw different tokens),
    nudge the selection bias (``router.expert_bias``) of layers with a ``bias_update_rate`` toward balance
    (DeepSeek-V3's auxiliary-loss-free balancing), and return the loads for logging (float
    tensors on the device, read at logging steps only: no host sync here)."""
    loads = {}
    for name, module in model.named_modules():
        if not getattr(module, "is_moe_layer", False) or module.step_load is None:
            continue
        load = module.step_load.float()
        for g in groups:
            if g is not None and dist.get_world_size(g) > 1:
                dist.all_reduce(load, group=g)
        rate = getattr(module, "bias_update_rate", 0.0)  # the layer's own: 0 for routers without a selection bias
        if rate:
            module.router.expert_bias += rate * torch.sign(load.mean() - load)
        loads[name] = load
        module.step_load = None
    return loads
