"""``fp8.param_gather``: the distributed optimizer all-gathers the FP8 linears' weights in FP8 (1 byte per
element) instead of BF16 (2 bytes), straight into the native FP8 linears' weight copies (docs/fp8.md).

After the optimizer step each data-parallel rank owns one shard of every bucket (``parallel/grad_buckets.py``). For the
buckets holding FP8 weights (``GradBuckets(separate_params=...)``; nothing else is in them) each rank
1. takes the amax of the pieces of each weight it owns, reduced (MAX) over the bucket's group (dp x cp) and over
   TP: exactly the amax of the whole weight that the BF16 path computes after its gather, so the same scale;
2. casts its pieces to FP8 with their weight's scale (an elementwise cast: the bytes are those of casting the
   whole weight), joins them into its shard, and all-gathers the shards into ``fp8_buffer``, a one-byte copy of the
   buckets' layout whose slices *are* the matmuls' ``w_a`` buffers (no copy); ``w_b`` (W^T) is made locally.
The FP8 copies are then bit-identical to what ``Fp8Runtime.refresh`` would make from gathered BF16 weights.

The BF16 values of these weights are now whole only in the shard this rank owns (``bf16_partial``). What may
read them: the FP8 runtime never re-casts a gathered weight from BF16 while they are partial (its copies are
current: only the optimizer changes the weights, and its step gathers them); ``gather_bf16`` (through
``MixedPrecisionAdamW.gather_full_params``) all-gathers them in BF16 on demand: the checkpoint writer calls it
before a save and the training loop at the end of a run. A matmul that would fall back to BF16 ``F.linear``
(a token count not a multiple of 16, GPU only) raises instead of using stale weights; weights whose dimensions
are not multiples of 16 always fall back, so they are not FP8-gathered at all, nor is a tied output layer's
weight (``fp8.output_layer`` with tied embeddings: the embedding lookup reads it in BF16). An untied FP8 output
layer is gathered like the blocks' linears; a weight that is a ``late`` parameter (the last pipeline stage's
copy of a tied embedding) stays in the BF16-gathered late bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmtrain.model.fp8_native import Fp8Casts, Fp8Matmul
from mmtrain.model.fp8_scaling import quantize


def _cast_pieces_into(src: torch.Tensor, scales: torch.Tensor, outs: list, plan: tuple, dtype: torch.dtype) -> None:
    for (lo, hi, k), out in zip(plan, outs):
        out.copy_(quantize(src[lo:hi], scales[k], dtype))


def transpose_into(flat: torch.Tensor, plan: tuple, b_bufs: list) -> None:
    """Each ``(lo, rows, cols)`` weight of the flat FP8 buffer ``flat``, transposed into its ``b_bufs`` entry."""
    for (lo, rows, cols), b in zip(plan, b_bufs):
        b.copy_(flat[lo:lo + rows * cols].view(rows, cols).t())


def cast_pieces(src: torch.Tensor, scales: torch.Tensor, outs: list[torch.Tensor], plan: tuple,
                dtype: torch.dtype, casts: Fp8Casts) -> None:
    """For each ``(lo, hi, k)`` of ``plan`` and its ``out``: ``out = fp8(src[lo:hi] * scales[k])``, clamped like
    every weight cast (the FP8 bytes of a rank's pieces of the weights; ``src`` is the flat BF16 buffer).
    Compiled on the GPU through ``casts`` (one graph instead of a few kernels per weight). Every output is a
    whole tensor of its own: Inductor turns writes into slices of one buffer into one kernel over the whole
    buffer that evaluates every slice's expression at every element."""
    if plan:
        casts.run(_cast_pieces_into, src.is_cuda, src, scales, outs, plan, dtype)


def gather_weights(runtime, cfg, group_size: int) -> list[torch.nn.Parameter]:
    """The weights to put in FP8 buckets (``GradBuckets(separate_params=...)``): empty unless ``fp8.param_gather``
    applies here (native per-tensor FP8, distributed optimizer, more than one rank sharing the buckets).
    Sets ``runtime.param_gather_note`` for its log line."""
    if runtime is None or not cfg.fp8.param_gather:
        return []
    if group_size == 1 or not cfg.parallel.distributed_optimizer:
        runtime.param_gather_note = "; fp8.param_gather is a no-op: one data-parallel rank, nothing to gather"
        return []
    if runtime.backend != "native":  # validated earlier; here so that a bypassed check cannot run silently
        raise ValueError("fp8.param_gather needs fp8.backend=native")
    return gatherable_weights(runtime)


def gatherable_weights(runtime) -> list[torch.nn.Parameter]:
    """The FP8 matmuls' weights an FP8 gather can serve: per-tensor scaled, trainable, 2-D with both dimensions
    multiples of 16 (else the GPU falls back to BF16), not a tied output layer's (``fp8.output_layer`` with tied
    embeddings: the embedding lookup reads it in BF16)."""
    embeddings = {id(m.embed.weight) for m in runtime.models if getattr(m, "embed", None) is not None}
    return [m.weight_ref for m in runtime.matmuls
            if m.recipe != "rowwise" and m.weight_ref.requires_grad and m.weight_ref.ndim == 2
            and m.weight_ref.shape[0] % 16 == 0 and m.weight_ref.shape[1] % 16 == 0
            and id(m.weight_ref) not in embeddings]


def whole_weight_amax(pieces: list[torch.Tensor], piece_of: torch.Tensor, count: int, device: torch.device,
                      group, tp_group) -> torch.Tensor:
    """(count,) float32: each weight's amax over the whole weight, from this rank's ``pieces`` (piece ``i`` of
    weight ``piece_of[i]``) reduced (MAX) over the data-parallel shards ``group`` and the TP shards (collective)."""
    amax = torch.zeros(count, dtype=torch.float32, device=device)
    if pieces:
        amax[piece_of] = torch.stack(torch._foreach_norm(pieces, float("inf"))).float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
    return amax


class Fp8ParamGather:
    """FP8 all-gather of the FP8 buckets of one ``GradBuckets`` (see the module docstring). Creating it attaches
    it to ``buckets`` (``buckets.separate_gather``: called by ``gather_params`` and ``gather_full_params``) and to ``runtime``
    (``runtime.param_gather``: no re-cast from partial BF16)."""

    def __init__(self, buckets, runtime, tp_group=None) -> None:
        self.owner, self.group, self.tp_group = buckets, buckets.group, tp_group
        by_weight = {id(m.weight_ref): m for m in runtime.matmuls if isinstance(m, Fp8Matmul)}
        self.buckets = [b for b in buckets.buckets if b.separate]
        params = [p for b in self.buckets for p in b.params]
        self.matmuls: list[Fp8Matmul] = [by_weight[id(p)] for p in params]
        if not self.matmuls:
            raise ValueError("no FP8 buckets to gather: build the GradBuckets with separate_params=gather_weights(...)")
        dtypes = {m.fwd_dtype for m in self.matmuls}
        if len(dtypes) != 1 or any(m.recipe == "rowwise" for m in self.matmuls):
            raise ValueError("fp8.param_gather needs per-tensor FP8 matmuls of one format")
        self.dtype = dtypes.pop()
        self.casts = self.matmuls[0].casts  # the model's compiled casts: the same bits as its per-step re-cast
        device = buckets.param_buffer.device
        total = sum(b.end - b.start for b in self.buckets)
        self.fp8_buffer = torch.zeros(total, dtype=torch.uint8, device=device)  # the buckets' layout, 1 byte each
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per bucket: (fp8_buffer slice, shard), bytes
        self.joins: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # per bucket: (pieces' bytes, shard part)
        pieces, outs, cast_plan, w_plan = [], [], [], []
        base = index = 0
        for b in self.buckets:
            own_start, own_end = buckets.owned_range(b)
            shard = torch.zeros(own_end - own_start, dtype=torch.uint8, device=device)  # padding stays zero
            self.views.append((self.fp8_buffer[base:base + b.end - b.start], shard))
            mine = []
            for p in b.params:  # packed from b.start: the owned pieces are adjacent, padding only at the end
                lo, hi = p.buffer_offset, p.buffer_offset + p.numel()
                self._adopt_w_a(self.matmuls[index], base + lo - b.start, p)
                w_plan.append((base + lo - b.start, *p.shape))
                s, e = max(lo, own_start), min(hi, own_end)
                if s < e:  # a weight is one range in one bucket: at most one owned piece of it per rank
                    pieces.append(buckets.param_buffer[s:e])
                    outs.append(torch.empty(e - s, dtype=self.dtype, device=device))
                    mine.append(outs[-1].view(torch.uint8))
                    cast_plan.append((s, e, index))
                index += 1
            if mine:
                self.joins.append((mine, shard[:sum(t.numel() for t in mine)]))
            base += b.end - b.start
        self.pieces, self.piece_outs = pieces, outs
        self.cast_plan, self.w_plan = tuple(cast_plan), tuple(w_plan)
        self.piece_of = torch.tensor([k for *_, k in cast_plan], dtype=torch.long, device=device)
        self.bf16_partial = False  # True from an FP8 gather until gather_bf16
        self.fp8_gathers = self.bf16_gathers = 0  # counts (tests, logs)
        buckets.separate_gather = self
        runtime.param_gather = self

    def _adopt_w_a(self, m: Fp8Matmul, offset: int, weight: torch.Tensor) -> None:
        """Make ``m.w_a`` a view of ``fp8_buffer`` (keeping a copy already cast there)."""
        view = self.fp8_buffer[offset:offset + weight.numel()].view(self.dtype).view(weight.shape)
        if m.w_a.shape == view.shape and m.w_a.dtype == view.dtype:
            view.copy_(m.w_a)
        m.w_a = view

    def describe(self) -> str:
        n = sum(p.numel() for b in self.buckets for p in b.params)
        return (f"; parameters of {len(self.matmuls)} FP8 linears ({n / 1e6:.2f}M elements) all-gathered in FP8 "
                f"over {dist.get_world_size(self.group)} data-parallel ranks")

    def managed(self) -> set[int]:
        """ids of the matmuls whose FP8 copies come from the gather and must not be re-cast from BF16 now."""
        return {id(m) for m in self.matmuls} if self.bf16_partial else set()

    @torch.no_grad()
    def gather(self) -> None:
        """After the optimizer updated this rank's shards: every rank gets the FP8 W (and W^T) of every weight."""
        amax = whole_weight_amax(self.pieces, self.piece_of, len(self.matmuls), self.fp8_buffer.device, self.group,
                                 self.tp_group)
        scales, inv = self.casts.weight_scales(amax, self.dtype)
        cast_pieces(self.owner.param_buffer, scales, self.piece_outs, self.cast_plan, self.dtype, self.casts)
        for parts, shard_part in self.joins:
            torch.cat(parts, out=shard_part)
        for full, shard in self.views:
            dist.all_gather_into_tensor(full, shard, group=self.group)
        for m in self.matmuls:
            if m.w_b.shape != m.w_a.t().shape or m.w_b.dtype != self.dtype:  # not sized yet: no forward before
                m.w_b = torch.empty_like(m.w_a.t().contiguous())
            for name in ("w_a_inv", "w_b_inv"):
                if getattr(m, name).shape != (1,):
                    setattr(m, name, torch.empty(1, device=amax.device))
        self.casts.run(transpose_into, amax.is_cuda, self.fp8_buffer.view(self.dtype), self.w_plan,
                       [m.w_b for m in self.matmuls])
        inv_list = list(inv.reshape(-1, 1).unbind(0))
        torch._foreach_copy_([m.w_a_inv for m in self.matmuls], inv_list)
        torch._foreach_copy_([m.w_b_inv for m in self.matmuls], inv_list)
        for m in self.matmuls:
            m.weight_stale = False
            m.bf16_weight_partial = True
        self.bf16_partial = True
        self.fp8_gathers += 1

    @torch.no_grad()
    def gather_bf16(self) -> None:
        """All-gather these weights in BF16 (collective), after which every rank's BF16 values are whole."""
        if not self.bf16_partial:
            return
        for b in self.buckets:
            self.owner.gather_bucket(b)
        for m in self.matmuls:
            m.bf16_weight_partial = False
        self.bf16_partial = False
        self.bf16_gathers += 1

    gather_full = gather_bf16  # what GradBuckets.gather_full_params calls (a separate_gather's whole values)
