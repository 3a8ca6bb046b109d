"""Attention kernels as strategy objects the model takes at construction (``GPTModel(..., attention=...)``).

A strategy has two calls: ``prepare(doc_ids_BS)`` once per micro-batch, in the model's (uncompiled) forward,
turns the per-token document ids of packed sequences into what its kernel needs (``None`` for plain causal
attention); ``strategy(q, k, v, prepared, scale)`` runs on (B, H, S, D) tensors inside the (possibly compiled)
block. What ``prepare`` returns flows through the blocks as an argument, so a new micro-batch with other
document boundaries is new data for the compiled region, never a recompile.

Document masks (query i attends key j iff j <= i and both lie in the same document) have two kernels:
- ``FlexDocuments``: a FlexAttention ``BlockMask`` built straight from per-block document ranges (O((S/128)²)
  work, no S×S tensor anywhere), with a ``mask_mod`` for the partial blocks on document boundaries. Blocks
  wholly inside one document below the diagonal are "full" and skip the mask. This is the GPU kernel:
  compiled, it skips the blocks that cross documents, so packed sequences cost less than causal ones.
- ``DenseDocuments``: the same mask as a bool (B, 1, Sq, Sk) tensor for SDPA. Only for the CPU, where
  FlexAttention has no backward (torch 2.11), and as the reference the tests compare with.
``CausalAttention(documents="auto")`` picks flex on CUDA tensors and dense on CPU ones.

Why flex rather than ``torch.nn.attention.varlen.varlen_attn`` (cu_seqlens, flash): flex was measured faster than
causal SDPA once documents are shorter than the sequence (issue 18's H200 table); varlen takes the tokens as one
flat (T, H, D) batch, not the (B, H, S, D) the blocks produce, and its API documents one head count for q, k and
v (GQA would expand K/V); a block mask is one builder for one device and for every context-parallel chunk pair.
``bench/attention_packed.py`` times both; another kernel would be one more class with ``mask``/``attend``.
Numbers: docs/packed-documents.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # FlexAttention's default tile; the block mask is built at this granularity


# ------------------------------------------------------------------------------------------ dense reference
def document_causal_mask(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, S, S) mask, True where query i may attend key j: j <= i and both in the same document.
    The dense reference (CPU kernel, tests); the GPU never builds it."""
    return dense_document_mask(doc_ids_BS, doc_ids_BS, 0)


def dense_document_mask(q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Bool (B, 1, Q, K): query i (at position ``i + q_offset`` of the keys) attends key j iff j <= i + offset
    and they share a document id."""
    Q, K = q_ids_BQ.shape[1], kv_ids_BK.shape[1]
    causal = torch.ones(Q, K, dtype=torch.bool, device=q_ids_BQ.device).tril(q_offset)
    return ((q_ids_BQ[:, :, None] == kv_ids_BK[:, None, :]) & causal)[:, None]


def dense_attention_with_lse(q, k, v, mask: torch.Tensor, scale: float | None):
    """Masked attention (B, H, Q, D) and its log-sum-exp (B, H, Q) in fp32 math, differentiable in both; rows
    without any attended key give 0 and -inf. The ring's CPU reference block kernel (K/V heads may be fewer)."""
    if q.shape[1] != k.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all-masked rows: exp(-inf) = 0, no NaN
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    safe_total = total.clamp_min(torch.finfo(total.dtype).tiny)
    out = (weights / safe_total) @ v.float()
    lse = torch.where(total > 0, torch.log(safe_total) + top, torch.full_like(top, float("-inf")))
    return out.to(q.dtype), lse.squeeze(-1)


class DenseDocuments:
    """Document masks as dense bool tensors for SDPA (CPU and the tests' reference)."""

    name = "dense"

    def mask(self, q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int) -> torch.Tensor:
        return dense_document_mask(q_ids_BQ, kv_ids_BK, q_offset)

    def attend(self, q, k, v, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def attend_with_lse(self, q, k, v, mask: torch.Tensor, scale: float | None):
        """(output, log-sum-exp of the scores per query), both differentiable: what a ring step merges.
        A query with no key under ``mask`` gets output 0 and log-sum-exp -inf (and finite gradients)."""
        return dense_attention_with_lse(q, k, v, mask, scale)


# ------------------------------------------------------------------------------------------ FlexAttention
def _block_ranges(ids_BS: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest document id in each block of ``block`` tokens (the last block may be short)."""
    B, S = ids_BS.shape
    n = -(-S // block)
    if n * block != S:  # repeat the last id: the padding adds no id range
        ids_BS = torch.cat([ids_BS, ids_BS[:, -1:].expand(B, n * block - S)], dim=1)
    blocks = ids_BS.view(B, n, block)
    return blocks.amin(-1), blocks.amax(-1)


def _ordered_blocks(keep_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) in BlockMask's layout: per query block, the kept key blocks first, in order."""
    keep = keep_BQK[:, None]
    indices = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return keep.sum(-1, dtype=torch.int32), indices


def document_block_mask(q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int, block: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` for the rule of ``dense_document_mask``, from per-block id ranges only.

    A key block can hold an attended key only if it starts at or before the query block's last position and
    the two id ranges overlap (true for any ids, sorted or not: a shared id lies in both ranges). It is
    *full* (no per-element mask) when both blocks hold one and the same id and the key block ends at or
    before the query block's first position."""
    from torch.nn.attention.flex_attention import BlockMask

    Q, K = q_ids_BQ.shape[1], kv_ids_BK.shape[1]
    q_min, q_max = _block_ranges(q_ids_BQ, block)
    k_min, k_max = _block_ranges(kv_ids_BK, block)
    dev = q_ids_BQ.device
    q_first = torch.arange(q_min.shape[1], device=dev) * block + q_offset
    q_last = torch.clamp(q_first - q_offset + block, max=Q) - 1 + q_offset
    k_first = torch.arange(k_min.shape[1], device=dev) * block
    k_last = torch.clamp(k_first + block, max=K) - 1
    overlap = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    some_causal = (k_first[None, :] <= q_last[:, None])[None]
    all_causal = (k_last[None, :] <= q_first[:, None])[None]
    one_doc = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
               & (q_min[:, :, None] == k_min[:, None, :]))
    full = overlap & all_causal & one_doc
    partial = overlap & some_causal & ~full
    kv_num, kv_idx = _ordered_blocks(partial)
    full_num, full_idx = _ordered_blocks(full)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_ids_BQ[b, q_idx] == kv_ids_BK[b, kv_idx]) & (q_idx + q_offset >= kv_idx)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(Q, K))


class FlexDocuments:
    """Document masks as FlexAttention block masks. Outside a compiled region the kernel is this object's own
    compiled ``flex_attention`` (eager flex would materialize the scores); inside one, dynamo inlines it into
    the block's graph."""

    name = "flex"

    def __init__(self, block: int = FLEX_BLOCK) -> None:
        self.block = block
        self._compiled = None

    def mask(self, q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int):
        return document_block_mask(q_ids_BQ, kv_ids_BK, q_offset, self.block)

    def attend(self, q, k, v, mask, scale: float | None) -> torch.Tensor:
        return self._kernel(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def _kernel(self, q):
        from torch.nn.attention.flex_attention import flex_attention

        if q.device.type == "cuda" and not torch.compiler.is_compiling():
            if self._compiled is None:
                self._compiled = torch.compile(flex_attention, dynamic=False)
            return self._compiled
        return flex_attention

    def attend_with_lse(self, q, k, v, mask, scale: float | None):
        """(output, natural log-sum-exp per query), both differentiable (flex's backward takes the log-sum-exp's
        gradient); a query with no key under the block mask gets 0 and -inf."""
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = self._kernel(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          return_aux=AuxRequest(lse=True))
        return out, aux.lse


def document_kernel(name: str, device: torch.device):
    """``"flex"``, ``"dense"``, or ``"auto"``: flex on CUDA, dense where flex has no backward (CPU)."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "dense"
    if name == "flex":
        return FlexDocuments()
    if name == "dense":
        return DenseDocuments()
    raise ValueError(f"document attention kernel must be 'auto', 'flex' or 'dense', got {name!r}")


# ------------------------------------------------------------------------------------------ strategies
class CausalAttention:
    """A decoder's attention: SDPA's causal kernel (flash/cuDNN on GPU) without documents; with document ids,
    the document kernel ``documents`` names (``"auto"``, ``"flex"``, ``"dense"``, or a kernel object)."""

    def __init__(self, documents: Any = "auto") -> None:
        self.documents = documents
        self._kernels: dict[str, Any] = {}  # one kernel object per device type: compiled blocks guard on it

    def kernel_for(self, device: torch.device):
        if not isinstance(self.documents, str):
            return self.documents
        if device.type not in self._kernels:
            self._kernels[device.type] = document_kernel(self.documents, device)
        return self._kernels[device.type]

    def prepare(self, doc_ids_BS: torch.Tensor | None) -> Any:
        """Once per micro-batch: None (plain causal) or ``(kernel, mask)`` for these document ids."""
        if doc_ids_BS is None:
            return None
        kernel = self.kernel_for(doc_ids_BS.device)
        return kernel, kernel.mask(doc_ids_BS, doc_ids_BS, 0)

    def __call__(self, q, k, v, prepared: Any, scale: float | None = None) -> torch.Tensor:
        if prepared is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        kernel, mask = prepared
        return kernel.attend(q, k, v, mask, scale)


class BidirectionalAttention:
    """An encoder's (ViT, audio) full attention; ``prepared`` is an optional bool key mask (True = attend)."""

    def prepare(self, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        return attn_mask

    def __call__(self, q, k, v, prepared: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prepared, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
