"""Token dispatch: how an MoE layer's (token, k) assignments reach their experts and come back. The layer takes
one of these strategy objects at construction (``LocalDispatch`` by default); ``mmtrain.parallel.expert``'s
``expert_dispatch`` picks the one for a mesh. Both strategies share one shape:

1. permute: one stable sort of the N·K assignments by expert id, then ONE gather of the token rows (an assignment
   over its expert's capacity sorts after every expert and is never computed nor sent);
2. run the experts on rows grouped by expert: counts per expert stay a device tensor (the grouped GEMM takes
   its group offsets on the device);
3. unpermute: ONE gather by the inverse permutation back to (token, k) order, and the routing-weighted sum over
   k as one batched matmul (deterministic: no scatter-add).

Host syncs. ``LocalDispatch`` reads nothing back (the per-expert loop used where no grouped GEMM exists reads
the counts: ``moe.Experts``). ``AllToAllDispatch`` with exact splits must hand ``all_to_all_single`` host split
sizes: ONE read-back of the (send, receive) row counts per MoE layer and micro-batch. ``padded=True`` sends
every rank a fixed block of ``N · min(K, experts per rank)`` rows instead — the worst case, so no assignment is
dropped — and keeps the counts on the device (no sync), for ``ep · min(K, E / ep) / K`` times the all-to-all
bytes (2x for 8 experts, top-2, EP2) and the padding's gathers. docs/expert-parallel.md compares
the two. Padded splits need every EP rank's micro-batch to hold the same number of tokens (fixed micro-batch
size and sequence length: always so in training).

``overlap_side_work``: the token all-to-all is started asynchronously and the layer's side work (its shared
experts) runs while the tokens travel; then the dispatch waits. Same numbers either way.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd; splits None: equal blocks. With ``pending`` (a list) the exchange is
    only started and its work appended there (``_Wait`` finishes it); backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                      async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        rows = grad.shape[0] if in_splits is None else sum(in_splits)
        back = grad.new_empty((rows, *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


class _Wait(torch.autograd.Function):
    """Finish the exchange ``_AllToAll`` started (identity on ``x`` for autograd)."""

    @staticmethod
    def forward(ctx, x, pending):
        pending.pop().wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of rows of ``x`` (splits None: equal blocks)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, None)


def count_per_expert(flat_ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Rows per id in ``[0, num_bins)`` (int64, on the device; unlike CUDA's ``bincount``, no host read of the max)."""
    return flat_ids.new_zeros(num_bins).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


def sort_by_expert(ids_NK: torch.Tensor, num_experts: int, keep_NK: torch.Tensor | None = None):
    """(order (N·K,), counts (E,)): assignments sorted by expert (stable: token order inside an expert; the ones
    ``keep_NK`` drops last) and rows per expert; ``order // K`` are the token rows to gather."""
    flat = ids_NK.flatten()
    if keep_NK is not None:  # dropped assignments go to a virtual expert past the end
        flat = torch.where(keep_NK.flatten(), flat, num_experts)
    return flat.argsort(stable=True), count_per_expert(flat, num_experts + 1)[:num_experts]


def combine_sorted(y_sorted: torch.Tensor, order: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """Expert outputs in sorted order (N·K rows; dropped ones zero) -> (N, D): gather by the inverse permutation,
    weight and sum over k in one batched matmul."""
    N, K = weights_NK.shape
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y_NKD = y_sorted.index_select(0, inverse).view(N, K, -1)
    return torch.bmm(weights_NK.to(y_NKD.dtype).unsqueeze(1), y_NKD).squeeze(1)


def _first_rows(total: int, count: torch.Tensor) -> torch.Tensor:
    """Boolean (total,) mask of the first ``count`` rows (``count`` a device scalar)."""
    return torch.arange(total, device=count.device) < count


class LocalDispatch:
    """Every expert on this device. ``token_groups``: groups a micro-batch's tokens are split over (TP under
    sequence parallelism, CP), over which the router sums expert loads for its balance loss."""

    ep_size = 1

    def __init__(self, token_groups: list = ()) -> None:
        self.token_groups = [g for g in token_groups if g is not None and dist.get_world_size(g) > 1]

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first, count): the experts this rank holds, which the layer builds (and nothing more)."""
        return 0, num_experts

    def __call__(self, x_ND: torch.Tensor, weights_NK: torch.Tensor, ids_NK: torch.Tensor, experts,
                 num_experts: int, keep_NK: torch.Tensor | None = None,
                 side_work: Callable[[], torch.Tensor] | None = None):
        """(routed output (N, D), ``side_work()``'s result or None). ``experts(rows, counts, valid)``: the
        layer's ``moe.Experts``."""
        order, counts = sort_by_expert(ids_NK, num_experts, keep_NK)
        valid = None if keep_NK is None else _first_rows(order.numel(), counts.sum())
        y_sorted = experts(x_ND.index_select(0, order // ids_NK.shape[1]), counts, valid)
        return combine_sorted(y_sorted, order, weights_NK), side_work() if side_work is not None else None


class AllToAllDispatch(LocalDispatch):
    """Experts split over ``group`` (``num_experts / ep`` consecutive ones per rank); tokens go to their
    experts' ranks and back with all-to-all. ``padded``: fixed worst-case splits, no host sync;
    ``overlap_side_work``: run the side work (shared experts) while the tokens travel."""

    def __init__(self, group, token_groups: list = (), padded: bool = False, overlap_side_work: bool = False):
        super().__init__(token_groups)
        self.group, self.ep_size, self.ep_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.padded, self.overlap_side_work = padded, overlap_side_work

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over parallel.ep={self.ep_size} "
                             "(model.num_experts must be divisible by parallel.ep)")
        local = num_experts // self.ep_size
        return self.ep_rank * local, local

    def __call__(self, x_ND, weights_NK, ids_NK, experts, num_experts, keep_NK=None, side_work=None):
        ep, local = self.ep_size, num_experts // self.ep_size
        (N, K), D = ids_NK.shape, x_ND.shape[-1]
        order, counts = sort_by_expert(ids_NK, num_experts, keep_NK)
        send_counts = counts.view(ep, local)  # [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, my local expert]
        x_sorted = x_ND.index_select(0, order // K)
        pending = [] if self.overlap_side_work and side_work is not None else None
        if self.padded:
            capacity = N * min(K, local)  # the most rows one rank can send another: no assignment is dropped
            slots = _padded_slots(send_counts.sum(dim=1), capacity, N * K)
            send = x_sorted.new_zeros(ep * capacity + 1, D).index_copy(0, slots, x_sorted)[:-1]
            recv = _AllToAll.apply(send, None, None, self.group, pending)
            rows = torch.arange(capacity, device=x_ND.device).expand(ep, capacity).contiguous()
            expert_of_row = torch.searchsorted(recv_counts.cumsum(dim=1), rows, right=True)  # local: padding
            out_splits = in_splits = None
        else:
            send_splits, recv_splits = torch.stack((send_counts.sum(dim=1), recv_counts.sum(dim=1))).tolist()
            kept = sum(send_splits)  # the one host read: all_to_all_single takes host split sizes
            recv = _AllToAll.apply(x_sorted[:kept], recv_splits, send_splits, self.group, pending)
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=x_ND.device).repeat(ep),
                                                    recv_counts.flatten(), output_size=sum(recv_splits))
            out_splits, in_splits = send_splits, recv_splits
        side = side_work() if side_work is not None else None
        if pending:
            recv = _Wait.apply(recv, pending)
        # received: by source rank, then local expert -> regroup by local expert, then source rank (padding last)
        regroup = expert_of_row.flatten().argsort(stable=True)
        per_expert = recv_counts.sum(dim=0)
        valid = _first_rows(recv.shape[0], per_expert.sum()) if self.padded else None
        y_local = experts(recv.index_select(0, regroup), per_expert, valid)
        y_recv = torch.empty_like(y_local).index_copy(0, regroup, y_local)
        y_back = _AllToAll.apply(y_recv, out_splits, in_splits, self.group, None)
        if self.padded:  # the last row: zeros for dropped assignments
            y_sorted = torch.cat((y_back, y_back.new_zeros(1, D))).index_select(0, slots)
        elif y_back.shape[0] < N * K:
            y_sorted = torch.cat((y_back, y_back.new_zeros(N * K - y_back.shape[0], D)))
        else:
            y_sorted = y_back
        return combine_sorted(y_sorted, order, weights_NK), side


def _padded_slots(dest_counts: torch.Tensor, capacity: int, assignments: int) -> torch.Tensor:
    """Row of each sorted assignment in the padded send buffer: destination rank d's block is rows
    [d·capacity, (d+1)·capacity); dropped assignments (past every destination) go to the extra last row."""
    ep = dest_counts.numel()
    ends = dest_counts.cumsum(dim=0)
    i = torch.arange(assignments, device=dest_counts.device)
    dest = torch.searchsorted(ends, i, right=True)
    d = dest.clamp(max=ep - 1)
    return torch.where(dest < ep, d * capacity + i - (ends - dest_counts)[d], ep * capacity)
