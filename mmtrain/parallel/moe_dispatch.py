"""Token dispatch: how an MoE layer's (token, k) assignments reach their experts and come back. The layer takes
one of these strategy objects at construction (``LocalDispatch`` by default); ``mmtrain.parallel.expert``'s
``expert_dispatch`` picks the one for a mesh. Both strategies share one shape:

1. permute: one stable sort of the N·K assignments by expert id, then ONE gather of the token rows (an assignment
   over its expert's capacity sorts after every expert and is never computed nor sent; with padded splits the
   gather writes the padded send buffer directly);
2. run the experts on rows grouped by expert: counts per expert stay a device tensor (the grouped GEMM takes
   its group offsets on the device);
3. unpermute: ONE row copy back to (token, k) order — ``index_copy`` by the sort order itself (a permutation: no
   inverse to compute, deterministic, its backward one gather), or with padded splits ONE gather through the
   composed index — and the routing-weighted sum over k as one batched matmul (no scatter-add).
Everything the row movement needs is integer index arithmetic on N·K entries; the D-wide rows move once each way.

Host syncs. ``LocalDispatch`` reads nothing back (the per-expert loop used where no grouped GEMM exists reads
the counts: ``moe.Experts``). ``AllToAllDispatch`` with exact splits must hand ``all_to_all_single`` host split
sizes: ONE read-back of the (send, receive) row counts per MoE layer and micro-batch. ``padded=True`` sends
every rank a fixed block of ``N · min(K, experts per rank)`` rows instead — the worst case, so no assignment is
dropped — and keeps the counts on the device (no sync), for ``ep · min(K, E / ep) / K`` times the all-to-all
bytes (2x for 8 experts, top-2, EP2) and the padding's gathers. docs/expert-parallel.md compares
the two. Padded splits need every EP rank's micro-batch to hold the same number of tokens (fixed micro-batch
size and sequence length: always so in training).

``overlap_side_work``: the token all-to-all is started asynchronously and the layer's side work (its shared
experts) runs while the tokens travel; then the dispatch waits. In backward the mirror image: the side work runs
on its own autograd graph (``_SideGraph``, detached from the layer's), and the backward of the combine exchange
(the first all-to-all of the layer's backward) starts the gradients' exchange asynchronously, runs the side
work's backward, then waits. Without the overlap the same side graph's backward runs as soon as its output
gradient arrives. Same numbers either way, bit for bit: the same ops on the same gradients, and the side work's
input gradient joins the layer's at the same place (``_JoinSideGrad``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd; splits None: equal blocks. With ``pending`` (a list) the exchange is
    only started and its work appended there (``_Wait`` finishes it); backward is the reverse exchange — with
    ``side`` (a ``_SideGraph`` to overlap) started asynchronously, the side work's backward run, then waited."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending, side=None):
        ctx.splits, ctx.group, ctx.side = (out_splits, in_splits), group, side
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
        side, ctx.side = ctx.side, None
        overlap = side is not None and side.ready()
        work = dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group,
                                      async_op=overlap)
        if side is not None:
            side.exchanged = True
        if overlap:
            side.run_backward()  # while the gradients travel
            work.wait()
        return back, None, None, None, None, None


class _SideGraph:
    """The side work (shared experts) on its own autograd graph, from a detached copy of the layer input, so
    the dispatch decides when its backward runs: inside the combine exchange's backward (``overlap``), or as
    soon as its output gradient arrives (``_SideOutput``). Built only where the layer input requires grad."""

    def __init__(self, overlap: bool) -> None:
        self.overlap, self.x, self.out, self.grad, self.exchanged = overlap, None, None, None, False

    def forward(self, side_work: Callable[[torch.Tensor], torch.Tensor], x_ND: torch.Tensor) -> torch.Tensor:
        """Run the side work on a detached copy of ``x_ND``; its output, detached (``_SideOutput`` links it)."""
        self.x = x_ND.detach().requires_grad_()
        self.out = side_work(self.x)
        return self.out.detach()

    def ready(self) -> bool:
        """Whether the overlapped backward can run now: overlap on, output gradient arrived, not yet run."""
        return self.overlap and self.grad is not None and self.out is not None

    def run_backward(self) -> None:
        """The side work's backward, once (parameter gradients accumulate as usual; the input's into ``x``)."""
        if self.out is not None and self.grad is not None:
            out, grad, self.out, self.grad = self.out, self.grad, None, None
            torch.autograd.backward(out, grad)


class _JoinSideGrad(torch.autograd.Function):
    """Identity on the layer input for the dispatch's gather; backward adds the side work's input gradient (its
    backward run here if nothing ran it yet). It runs after both exchanges' backward (the gather feeds them)."""

    @staticmethod
    def forward(ctx, x, side):
        ctx.side = side
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        side, ctx.side = ctx.side, None
        side.run_backward()
        return (grad if side.x.grad is None else grad + side.x.grad), None


class _SideOutput(torch.autograd.Function):
    """The side work's output in the layer's graph. ``anchor``: the combine exchange's output (it gets no
    gradient here), so this backward runs before the combine's: it hands the output gradient to the side graph
    and runs the side backward at once unless the combine's backward will overlap it."""

    @staticmethod
    def forward(ctx, anchor, value, side):
        ctx.side = side
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        side, ctx.side = ctx.side, None
        side.grad = grad
        if not side.overlap or side.exchanged:
            side.run_backward()
        return None, None, None


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
    """Expert outputs in sorted order -> (N, D): ONE ``index_copy`` back to (token, k) order by the sort order
    (its first ``len(y_sorted)`` entries; the assignments past them, dropped ones, are zero), then the weighted
    sum over k in one batched matmul."""
    N, K = weights_NK.shape
    rows, D = y_sorted.shape
    buffer = y_sorted.new_empty if rows == N * K else y_sorted.new_zeros
    y_NKD = buffer(N * K, D).index_copy(0, order[:rows], y_sorted).view(N, K, D)
    return _weighted_sum(y_NKD, weights_NK)


class _RowsByOrder(torch.autograd.Function):
    """``x_ND.index_select(0, order // K)``: each token's row repeated for its K assignments, in sorted order.
    Its backward is ``index_select``'s own, an ``index_add`` with atomics (BF16 atomics: 2.7 ms per micro-batch
    of issue #32's MoE row); here each token has exactly K rows, so the gradient goes back to (token, k) order
    by one ``index_copy`` (a permutation) and is summed over k: deterministic, no atomics."""

    @staticmethod
    def forward(ctx, x_ND, order, K):
        ctx.save_for_backward(order)
        ctx.N, ctx.K = x_ND.shape[0], K
        return x_ND.index_select(0, order // K)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        by_token = grad.new_empty(ctx.N * ctx.K, grad.shape[1]).index_copy(0, order, grad)
        return by_token.view(ctx.N, ctx.K, -1).sum(1), None, None


def rows_by_order(x_ND: torch.Tensor, order: torch.Tensor, K: int) -> torch.Tensor:
    """Token rows in expert-sorted order (``order``: a permutation of the N*K assignments)."""
    return _RowsByOrder.apply(x_ND, order, K)


def _weighted_sum(y_NKD: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
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
                 side_work: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """(routed output (N, D), ``side_work(x_ND)``'s result or None). ``experts(rows, counts, valid)``: the
        layer's ``moe.Experts``."""
        order, counts = sort_by_expert(ids_NK, num_experts, keep_NK)
        valid = None if keep_NK is None else _first_rows(order.numel(), counts.sum())
        y_sorted = experts(rows_by_order(x_ND, order, ids_NK.shape[1]), counts, valid)
        return combine_sorted(y_sorted, order, weights_NK), side_work(x_ND) if side_work is not None else None


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
        graph, joined = None, x_ND  # the side work on its own graph, its backward placed here (module docstring)
        if side_work is not None and torch.is_grad_enabled() and x_ND.requires_grad:
            graph = _SideGraph(self.overlap_side_work)
            joined = _JoinSideGrad.apply(x_ND, graph)
        token = order // K
        pending = [] if self.overlap_side_work and side_work is not None else None
        if self.padded:
            capacity = N * min(K, local)  # the most rows one rank can send another: no assignment is dropped
            slots = _padded_slots(send_counts.sum(dim=1), capacity, N * K)
            # the token of each send row (padding rows: token 0, never computed: ``valid`` below), ONE gather
            send_token = token.new_zeros(ep * capacity + 1).index_copy_(0, slots, token)[:-1]
            recv = _AllToAll.apply(joined.index_select(0, send_token), None, None, self.group, pending)
            rows = torch.arange(capacity, device=x_ND.device).expand(ep, capacity).contiguous()
            expert_of_row = torch.searchsorted(recv_counts.cumsum(dim=1), rows, right=True)  # local: padding
            out_splits = in_splits = None
        else:
            send_splits, recv_splits = torch.stack((send_counts.sum(dim=1), recv_counts.sum(dim=1))).tolist()
            kept = sum(send_splits)  # the one host read: all_to_all_single takes host split sizes
            recv = _AllToAll.apply(joined.index_select(0, token[:kept]), recv_splits, send_splits, self.group,
                                   pending)
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=x_ND.device).repeat(ep),
                                                    recv_counts.flatten(), output_size=sum(recv_splits))
            out_splits, in_splits = send_splits, recv_splits
        side = None
        if graph is not None:
            side = graph.forward(side_work, x_ND)
        elif side_work is not None:
            side = side_work(x_ND)
        if pending:
            recv = _Wait.apply(recv, pending)
        # received: by source rank, then local expert -> regroup by local expert, then source rank (padding last)
        regroup = expert_of_row.flatten().argsort(stable=True)
        per_expert = recv_counts.sum(dim=0)
        valid = _first_rows(recv.shape[0], per_expert.sum()) if self.padded else None
        y_local = experts(recv.index_select(0, regroup), per_expert, valid)
        y_recv = torch.empty_like(y_local).index_copy(0, regroup, y_local)
        y_back = _AllToAll.apply(y_recv, out_splits, in_splits, self.group, None, graph)
        if self.padded:  # ONE gather: (token, k) <- its slot's row (the extra last row: zeros, dropped ones)
            source = torch.empty_like(order).scatter_(0, order, slots)
            y_NKD = torch.cat((y_back, y_back.new_zeros(1, D))).index_select(0, source).view(N, K, D)
            routed = _weighted_sum(y_NKD, weights_NK)
        else:
            routed = combine_sorted(y_back, order, weights_NK)
        if graph is not None:  # anchored on the combine's output: its backward runs before the combine's
            side = _SideOutput.apply(y_back, side, graph)
        return routed, side


def _padded_slots(dest_counts: torch.Tensor, capacity: int, assignments: int) -> torch.Tensor:
    """Row of each sorted assignment in the padded send buffer: destination rank d's block is rows
    [d·capacity, (d+1)·capacity); dropped assignments (past every destination) go to the extra last row."""
    ep = dest_counts.numel()
    ends = dest_counts.cumsum(dim=0)
    i = torch.arange(assignments, device=dest_counts.device)
    dest = torch.searchsorted(ends, i, right=True)
    d = dest.clamp(max=ep - 1)
    return torch.where(dest < ep, d * capacity + i - (ends - dest_counts)[d], ep * capacity)
