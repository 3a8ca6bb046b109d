"""``parallel.fsdp`` with native FP8: each block's FP8 weights are gathered in FP8 (1 byte per element) for use,
straight into the FP8 linears' weight copies, and freed after, like the block's other parameters (docs/fp8.md,
docs/parallelism.md). It is ``fp8.param_gather`` (``fp8_param_gather.py``) moved from once per step to once per use.

``FsdpBuckets(separate_params=fsdp_gather_weights(...))`` puts a block's FP8 weights in a second bucket of the
block's unit (``Bucket.separate``); ``Fp8FsdpGather`` attaches to it (``buckets.separate_gather``) and to the FP8
runtime (``runtime.param_gather``: these copies are never re-cast from BF16, whose values stay sharded). Per unit:

- after each optimizer step (and at the start, and after a checkpoint load) a rank casts its owned shard of the
  unit's BF16 values to FP8 into a persistent one-byte shard (``shard``), with each weight's scale from the
  amax of the whole weight (the owned pieces' amaxes reduced, MAX, over the bucket's group and over TP): the
  bytes are those of casting the whole weight, as the BF16 path's refresh does;
- when FSDP gathers the block (forward, and again for its backward) the FP8 shards are all-gathered into
  ``full``, whose slices *are* the matmuls' ``w_a``; each ``w_b`` (W^T, for dgrad) is transposed locally into a
  tensor of its own; all are freed (storage resized to 0 bytes) when FSDP frees the unit.

Saved for backward is ``w_b`` (the dgrad operand): its refill by the backward gather keeps its version counter
(as the BF16 parameters' all-gather leaves theirs), so autograd accepts the same storage refilled with the same
bytes. The BF16 values of these weights are whole only in ``gather_full_params``
(checkpoint save, end of run); a matmul that would fall back to BF16 ``F.linear`` raises instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmtrain.model.fp8_native import Fp8Matmul
from mmtrain.model.fp8_param_gather import gatherable_weights, transpose_into, whole_weight_amax
from mmtrain.model.fp8_scaling import quantize


def fsdp_gather_weights(runtime, unit_params: set[int]) -> list[torch.nn.Parameter]:
    """The FP8 weights inside FSDP units (``unit_params``: ids of the blocks' parameters), all gathered in FP8;
    the other FP8 matmuls (an FP8 output layer, whole on every rank) keep the runtime's BF16 re-cast. Raises if
    a unit's FP8 linear cannot be: its BF16 weight is never whole for a re-cast."""
    if runtime.backend != "native":  # validated earlier; here so that a bypassed check cannot run silently
        raise ValueError("parallel.fsdp with train.precision=fp8 needs fp8.backend=native")
    eligible = {id(p) for p in gatherable_weights(runtime)}
    chosen = []
    for m in runtime.matmuls:
        if id(m.weight_ref) not in unit_params:
            continue
        if id(m.weight_ref) not in eligible:
            raise ValueError(f"parallel.fsdp with FP8: a block's FP8 linear of shape {tuple(m.weight_ref.shape)} "
                             "cannot be gathered in FP8 (it needs a per-tensor recipe and both dimensions "
                             "multiples of 16)")
        chosen.append(m.weight_ref)
    return chosen


def _cast_shard_pieces(srcs: list, scales: torch.Tensor, outs: list, index: tuple, dtype: torch.dtype) -> None:
    for src, out, k in zip(srcs, outs, index):
        out.copy_(quantize(src, scales[k], dtype))


class Fp8FsdpGather:
    """The FP8 gather of one ``FsdpBuckets``' separate buckets (see the module docstring). Creating it casts the
    FP8 shards (collective) and attaches it to ``buckets`` and ``runtime``."""

    def __init__(self, buckets, runtime, tp_group=None) -> None:
        self.owner, self.group, self.tp_group = buckets, buckets.group, tp_group
        by_weight = {id(m.weight_ref): m for m in runtime.matmuls if isinstance(m, Fp8Matmul)}
        self.buckets = [b for b in buckets.units if b.separate]
        self.matmuls: list[Fp8Matmul] = [by_weight[id(p)] for b in self.buckets for p in b.params]
        if not self.matmuls:
            raise ValueError("no FP8 units to gather: build the FsdpBuckets with "
                             "separate_params=fsdp_gather_weights(...)")
        dtypes = {m.fwd_dtype for m in self.matmuls}
        if len(dtypes) != 1 or any(m.recipe == "rowwise" for m in self.matmuls):
            raise ValueError("parallel.fsdp with FP8 needs per-tensor FP8 matmuls of one format")
        self.dtype = dtypes.pop()
        self.casts = self.matmuls[0].casts  # the model's compiled casts: the same bits as its BF16 re-cast
        device = buckets.device
        self.full, self.shard = {}, {}  # per bucket (by id): one-byte buffers
        self.transposed: dict[int, list[torch.Tensor]] = {}  # per bucket (by id): each weight's W^T, a tensor each
        self.pieces, self.piece_outs, self.piece_index, self.joins = [], [], [], []
        index = 0
        self.first: dict[int, int] = {}  # per bucket (by id): index in self.matmuls of its first weight
        self.t_plan: dict[int, tuple] = {}  # per bucket (by id): (offset, rows, cols) of each weight
        for b in self.buckets:
            self.first[id(b)] = index
            self.t_plan[id(b)] = tuple((p.buffer_offset - b.start, *p.shape) for p in b.params)
            n = b.end - b.start
            own_start, own_end = buckets.owned_range(b)
            full = torch.zeros(n, dtype=torch.uint8, device=device)
            shard = torch.zeros(own_end - own_start, dtype=torch.uint8, device=device)  # padding stays zero
            self.full[id(b)], self.shard[id(b)] = full, shard
            self.transposed[id(b)] = []
            mine = []
            for p in b.params:  # packed from b.start: the owned pieces are adjacent, padding only at the end
                m = self.matmuls[index]
                lo = p.buffer_offset - b.start
                m.w_a = full[lo:lo + p.numel()].view(self.dtype).view(p.shape)
                # W^T: a whole tensor of its own (Inductor would turn writes into slices of one buffer into one
                # kernel evaluating every slice's expression at every element of it)
                m.w_b = torch.zeros(p.shape[1], p.shape[0], dtype=self.dtype, device=device)
                self.transposed[id(b)].append(m.w_b)
                m.w_a_inv, m.w_b_inv = torch.ones(1, device=device), torch.ones(1, device=device)
                m.weight_stale, m.bf16_weight_partial = False, True
                s, e = max(p.buffer_offset, own_start), min(p.buffer_offset + p.numel(), own_end)
                if s < e:  # at most one owned piece of a weight per rank
                    self.pieces.append(buckets.param_values(b, s, e))
                    self.piece_outs.append(torch.empty(e - s, dtype=self.dtype, device=device))
                    self.piece_index.append(index)
                    mine.append(self.piece_outs[-1].view(torch.uint8))
                index += 1
            if mine:
                self.joins.append((mine, shard[:sum(t.numel() for t in mine)]))
            for t in (full, *self.transposed[id(b)]):
                t.untyped_storage().resize_(0)
        self.piece_of = torch.tensor(self.piece_index, dtype=torch.long, device=device)
        self.piece_index = tuple(self.piece_index)
        self.unit_gathers = self.shard_casts = 0  # counts (tests, logs)
        buckets.separate_gather = self
        runtime.param_gather = self
        self.gather()

    def describe(self) -> str:
        n = sum(p.numel() for b in self.buckets for p in b.params)
        return (f"; with parallel.fsdp the blocks' {len(self.matmuls)} FP8 linears ({n / 1e6:.2f}M elements) are "
                f"gathered in FP8 over {dist.get_world_size(self.group)} data-parallel ranks")

    def managed(self) -> set[int]:
        """ids of the matmuls whose FP8 copies come from this gather (never re-cast from BF16)."""
        return {id(m) for m in self.matmuls}

    @torch.no_grad()
    def gather(self) -> None:
        """After the optimizer updated this rank's shards (collective): its FP8 shards cast from them, every
        weight with the scale of its whole weight; the scales go to every matmul."""
        amax = whole_weight_amax(self.pieces, self.piece_of, len(self.matmuls), self.owner.device, self.group,
                                 self.tp_group)
        scales, inv = self.casts.weight_scales(amax, self.dtype)
        if self.pieces:
            self.casts.run(_cast_shard_pieces, amax.is_cuda, self.pieces, scales, self.piece_outs,
                           self.piece_index, self.dtype)
        for parts, shard_part in self.joins:
            torch.cat(parts, out=shard_part)
        inv_list = list(inv.reshape(-1, 1).unbind(0))
        torch._foreach_copy_([m.w_a_inv for m in self.matmuls], inv_list)
        torch._foreach_copy_([m.w_b_inv for m in self.matmuls], inv_list)
        self.shard_casts += 1

    params_loaded = gather  # after a checkpoint load wrote new shards: cast them again

    def start_unit(self, b):
        """FSDP gathers unit ``b`` for use: start the all-gather of its FP8 shards (async; returns the work)."""
        full = self.full[id(b)]
        with torch.autograd._unsafe_preserve_version_counter(full):
            full.untyped_storage().resize_(full.numel())
            return dist.all_gather_into_tensor(full, self.shard[id(b)], group=self.group, async_op=True)

    @torch.no_grad()
    def finish_unit(self, b) -> None:
        """After the gather landed: W^T of every weight of ``b`` (the dgrad operand, maybe saved for backward)."""
        full, transposed = self.full[id(b)], self.transposed[id(b)]
        with torch.autograd._unsafe_preserve_version_counter(tuple(transposed)):
            for t in transposed:
                t.untyped_storage().resize_(t.numel())
            self.casts.run(transpose_into, full.is_cuda, full.view(self.dtype), self.t_plan[id(b)], transposed)
        self.unit_gathers += 1

    def free_unit(self, b) -> None:
        tensors = (self.full[id(b)], *self.transposed[id(b)])
        with torch.autograd._unsafe_preserve_version_counter(tensors):
            for t in tensors:
                t.untyped_storage().resize_(0)

    def gather_full(self) -> None:
        """Whole BF16 values: ``FsdpBuckets.gather_full_params`` gathers them itself."""
