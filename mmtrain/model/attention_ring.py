"""Ring context-parallel attention (``parallel.cp_comm=ring``): the K/V exchange hidden behind attention.

Each rank holds two zig-zag chunks of the sequence (``mmtrain.parallel.context``): chunk ``r`` and chunk
``2·cp−1−r``. Its K/V *block* (both chunks) travels around the CP ring; at step ``s`` rank ``r`` holds the
block of rank ``(r − s) mod cp`` and, while its local query chunks attend to that block, already sends it on
to ``r + 1`` and receives the next one from ``r − 1`` (one ``batch_isend_irecv`` per step into the other of
two buffers). The partial results are merged by their log-sum-exp (online softmax, fp32). Under the causal
mask the zig-zag layout makes every step after the first the same work on every rank:

- step 0 (own block): chunk r × chunk r (causal), chunk 2cp−1−r × chunk r (full), × chunk 2cp−1−r (causal);
- a block from a lower rank: both query chunks × its first chunk (full; its second chunk lies in the future);
- from a higher rank: the late query chunk × both of its chunks (full; the early chunk sees none of it).

Packed documents add a document mask to each of these calls (built once per micro-batch in ``prepare`` from
the all-gathered document ids: dense on the CPU, FlexAttention block masks on the GPU).

Backward is a ring too (an explicit ``autograd.Function``, not autograd over the forward): the K/V blocks go
round again, each with an fp32 dK/dV accumulator that travels with it and gets home after the last step;
the exchange of step s overlaps step s's block gradients. Per layer that is cp−1 exchanges forward and
cp+1 backward (the last, dK/dV home, is not hidden), and only the local K/V, output and log-sum-exp are
saved (the all-gather saves the whole sequence's K/V per layer). Block gradients use the *merged* output
and log-sum-exp: without documents the flash kernel's own backward (``aten._scaled_dot_product_flash_
attention[_for_cpu]_backward``) takes them directly; the document kernels (dense, flex) have no such entry
point, so their block forward is recomputed with autograd and fed the merged gradients (one extra block
forward per step: the cost of documents on the ring).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mmtrain.model.attention import CausalAttention, refuse_window_sinks_softcap
from mmtrain.parallel.comm import gather_seq_no_reduce
from mmtrain.parallel.context import zigzag_global_order

_aten = torch.ops.aten


def ring_calls(cp: int, rank: int, step: int) -> list[tuple[slice, slice, bool]]:
    """The attention calls of one ring step, in chunk units of the local queries and of the K/V block held:
    (query chunks, key chunks, causal). Causal calls are square diagonal chunk pairs; the others see all keys."""
    src = (rank - step) % cp
    if step == 0:
        return [(slice(0, 1), slice(0, 1), True), (slice(1, 2), slice(0, 1), False), (slice(1, 2), slice(1, 2), True)]
    if src < rank:
        return [(slice(0, 2), slice(0, 1), False)]
    return [(slice(1, 2), slice(0, 2), False)]


def _tokens(chunks: slice, c: int) -> slice:
    return slice(chunks.start * c, chunks.stop * c)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of an expanded K/V back on its ``heads`` (sum over each group's query heads)."""
    B, H, S, D = grad.shape
    return grad if H == heads else grad.view(B, heads, H // heads, S, D).sum(2)


class FlashBlocks:
    """Causal / full blocks without documents: SDPA's flash kernel (CUDA half precision; the CPU's flash kernel
    for any dtype), whose backward takes the merged output and log-sum-exp. K/V heads are expanded per call
    (GQA): the exchanged blocks stay compact."""

    def __init__(self) -> None:
        self._unused = None  # the CUDA kernel's (sequence offsets, RNG seed, offset) of a call: unread without dropout

    def forward(self, q, k, v, causal: bool, mask: Any, scale):
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        if q.device.type == "cpu":
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        self._unused = cum_q, cum_k, seed, offset  # handed back as they came, as torch's own CP does
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, mask: Any, scale):
        heads = k.shape[1]
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        lse = lse.contiguous()  # a slice of the merged (B, H, 2c): the CUDA kernel reads it without strides
        if q.device.type == "cpu":
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        else:  # a forward of this object always ran before (the ring's forward)
            cum_q, cum_k, seed, offset = self._unused
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
        return dq, _fold_heads(dk, heads), _fold_heads(dv, heads)


class DocumentBlocks:
    """Blocks under a document mask, on a kernel with a differentiable ``attend_with_lse`` (dense, flex). The
    backward recomputes the block and hands autograd the gradients the merge implies: for block j with weight
    w = exp(lse_j − LSE), d out_j = w·dO and d lse_j = w·(rowsum(dO·out_j) − rowsum(dO·O))."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def forward(self, q, k, v, causal: bool, mask: Any, scale):
        return self.kernel.attend_with_lse(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, causal: bool, mask: Any, scale):
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out_j, lse_j = self.kernel.attend_with_lse(q_, k_, v_, mask, scale)
            w = torch.exp(lse_j.float() - lse.float())
            dout_f = dout.float()
            d_lse = w * ((dout_f * out_j.detach().float()).sum(-1) - (dout_f * out.float()).sum(-1))
            return torch.autograd.grad((out_j, lse_j), (q_, k_, v_),
                                       ((w[..., None] * dout_f).to(out_j.dtype), d_lse.to(lse_j.dtype)))


def _merge(out_acc, lse_acc, out, lse, first: bool) -> None:
    """Fold one block's (output, log-sum-exp) into the fp32 accumulators, in place (online softmax); the
    ``first`` block of these queries is copied."""
    if first:
        out_acc.copy_(out)
        lse_acc.copy_(lse)
        return
    new = torch.logaddexp(lse_acc, lse.float())
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows no key has reached yet stay 0
    out_acc.mul_(torch.exp(lse_acc - safe)[..., None]).add_(out.float() * torch.exp(lse.float() - safe)[..., None])
    lse_acc.copy_(new)


class _Ring:
    """One layer call's ring: the CP group's neighbours, the block kernel and, per step, the calls' masks."""

    def __init__(self, group, blocks, masks, scale) -> None:
        self.group, self.blocks, self.masks, self.scale = group, blocks, masks, scale
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp

    def exchange(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """Start sending each ``(send, recv)`` pair's first tensor to the next rank and receiving the previous
        rank's into the second; one batched call. Returns the requests to wait on."""
        ops = []
        for send, recv in pairs:
            ops += [dist.P2POp(dist.isend, send, group=self.group, group_peer=self.next),
                    dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev)]
        return dist.batch_isend_irecv(ops)

    def calls(self, step: int):
        for i, (qs, ks, causal) in enumerate(ring_calls(self.cp, self.rank, step)):
            yield qs, ks, causal, None if self.masks is None else self.masks[step][i]


def _wait(requests) -> None:
    for r in requests:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        c = q.shape[2] // 2
        kv, incoming = torch.stack([k, v]), None
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        reached = set()  # local query chunks some block has been merged into
        for step in range(ring.cp):
            requests = []
            if step < ring.cp - 1:
                incoming = torch.empty_like(kv) if incoming is None else incoming
                requests = ring.exchange([(kv, incoming)])
            for qs, ks, causal, mask in ring.calls(step):
                q_tok, k_tok = _tokens(qs, c), _tokens(ks, c)
                o, l = ring.blocks.forward(q[:, :, q_tok], kv[0][:, :, k_tok], kv[1][:, :, k_tok], causal, mask,
                                           ring.scale)
                chunks = set(range(qs.start, qs.stop))
                _merge(out[:, :, q_tok], lse[:, :, q_tok], o, l, first=not reached & chunks)
                reached |= chunks
            _wait(requests)
            kv, incoming = incoming, kv  # double buffer: the block just used receives the one after next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        c = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, incoming = torch.stack([k, v]), None
        dkv, dkv_in = None, None  # dK/dV of the block this rank worked on last; the buffer for the next one
        for step in range(ring.cp):
            pairs = []
            if step < ring.cp - 1:
                incoming = torch.empty_like(kv) if incoming is None else incoming
                pairs.append((kv, incoming))
            if step > 0:  # last step's dK/dV go on with their block; the next block's arrive with theirs
                dkv_in = torch.empty_like(dkv) if dkv_in is None else dkv_in
                pairs.append((dkv, dkv_in))
            requests = ring.exchange(pairs) if pairs else []
            part = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for qs, ks, causal, mask in ring.calls(step):
                q_tok, k_tok = _tokens(qs, c), _tokens(ks, c)
                dq_c, dk_c, dv_c = ring.blocks.backward(dout[:, :, q_tok], q[:, :, q_tok], kv[0][:, :, k_tok],
                                                        kv[1][:, :, k_tok], out[:, :, q_tok], lse[:, :, q_tok],
                                                        causal, mask, ring.scale)
                dq[:, :, q_tok] += dq_c
                part[0][:, :, k_tok] += dk_c
                part[1][:, :, k_tok] += dv_c
            _wait(requests)
            if step > 0:
                part += dkv_in
                dkv_in = dkv  # sent and waited for: free to receive into
            dkv = part
            kv, incoming = incoming, kv
        home = torch.empty_like(dkv) if dkv_in is None else dkv_in
        _wait(ring.exchange([(dkv, home)]))  # the last accumulator goes to its block's owner
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None


@torch.compiler.disable  # point-to-point calls are not traceable: the compiled block runs around this call
def ring_attention(q, k, v, group, blocks, masks, scale) -> torch.Tensor:
    return _RingAttention.apply(q, k, v, _Ring(group, blocks, masks, scale))


class RingContextParallelAttention(CausalAttention):
    """Causal (optionally document-masked) attention of this rank's two zig-zag query chunks, the K/V blocks
    of the CP ``group`` passed around a ring behind the computation. ``documents``: the document kernel, as
    for ``CausalAttention``."""

    def __init__(self, group, documents: Any = "auto") -> None:
        super().__init__(documents)
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._flash = FlashBlocks()
        self._document_blocks: dict[int, DocumentBlocks] = {}  # per kernel: compiled blocks guard on the object

    def prepare(self, doc_ids_BS: torch.Tensor | None, window: int | None = None) -> Any:
        """Per ring step, the document mask of each of its calls (None: causal). The ids of the whole
        sequence are all-gathered once per micro-batch; the masks serve every layer. A sliding window is refused
        (its "full" calls lift causality by an offset that is no true position)."""
        refuse_window_sinks_softcap("ring context-parallel attention", window)
        if doc_ids_BS is None:
            return None
        kernel = self.kernel_for(doc_ids_BS.device)
        all_ids = zigzag_global_order(gather_seq_no_reduce(doc_ids_BS, self.group, dim=1), self.cp, 1)
        return self._blocks_for(kernel), self._step_masks(kernel, doc_ids_BS, all_ids)

    def _blocks_for(self, kernel) -> DocumentBlocks:
        if id(kernel) not in self._document_blocks:
            self._document_blocks[id(kernel)] = DocumentBlocks(kernel)
        return self._document_blocks[id(kernel)]

    def _step_masks(self, kernel, doc_ids_BS: torch.Tensor, all_ids: torch.Tensor) -> list[list[Any]]:
        c = doc_ids_BS.shape[1] // 2
        chunk = lambda g: all_ids[:, g * c:(g + 1) * c]  # noqa: E731
        masks = []
        for step in range(self.cp):
            src = (self.rank - step) % self.cp
            block = torch.cat([chunk(src), chunk(2 * self.cp - 1 - src)], dim=1)
            step_masks = []
            for qs, ks, causal in ring_calls(self.cp, self.rank, step):
                q_ids, kv_ids = doc_ids_BS[:, _tokens(qs, c)], block[:, _tokens(ks, c)]
                # a full call's keys all precede its queries: an offset past the last key lifts causality
                step_masks.append(kernel.mask(q_ids, kv_ids, 0 if causal else kv_ids.shape[1]))
            masks.append(step_masks)
        return masks

    def __call__(self, q, k, v, prepared: Any, scale: float | None = None, sinks_H: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        refuse_window_sinks_softcap("ring context-parallel attention", None, sinks_H, softcap)
        if q.shape[2] % 2:
            raise ValueError(f"ring attention needs the two zig-zag chunks of equal length, got {q.shape[2]} tokens")
        if prepared is None:
            blocks, masks = self._flash, None
            if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
                blocks, masks = self._blocks_for(self.kernel_for(q.device)), self._causal_masks(q)
        else:
            blocks, masks = prepared
        return ring_attention(q, k, v, self.group, blocks, masks, scale)

    def _causal_masks(self, q):
        """fp32 on CUDA (no flash kernel): the document kernel with every token in one document."""
        kernel = self.kernel_for(q.device)
        ids = torch.zeros(q.shape[0], q.shape[2] * self.cp, dtype=torch.long, device=q.device)
        return self._step_masks(kernel, ids[:, :q.shape[2]], ids)
