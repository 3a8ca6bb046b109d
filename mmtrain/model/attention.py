"""Attention kernels as strategy objects the model takes at construction (``GPTModel(..., attention=...)``).

A strategy has two calls: ``prepare(doc_ids_BS, window=None)`` once per micro-batch (and per distinct window),
in the model's (uncompiled) forward, turns the per-token document ids of packed sequences and an optional sliding
window into what its kernel needs (``None`` for plain causal attention); ``strategy(q, k, v, prepared, scale=None,
sinks_H=None, softcap=None)`` runs on (B, H, S, D) tensors inside the (possibly compiled) block. What ``prepare``
returns flows through the blocks as an argument, so a new micro-batch with other document boundaries is new data
for the compiled region, never a recompile.

The mask: query i attends key j iff j <= i, both lie in the same document (when ids are given) and, with a window
W, i - j < W (Hugging Face's sliding window: the query and the W-1 keys before it). ``scale`` replaces
1/sqrt(D); ``softcap`` c maps the scaled scores to c·tanh(score/c) (Gemma); ``sinks_H`` is one fp32 logit per
query head that joins the softmax denominator only (GPT-OSS): out·Z/(Z + e^sink) = out·sigmoid(lse − sink), from
the kernel's log-sum-exp, so it stays differentiable through either kernel.

Document and window masks have two kernels:
- ``FlexDocuments``: a FlexAttention ``BlockMask`` built straight from per-block document ranges (O((S/128)²)
  work, no S×S tensor anywhere), with a ``mask_mod`` for the partial blocks on document boundaries. Blocks
  wholly inside one document and inside the window are "full" and skip the mask; blocks wholly outside the
  window or across documents are not visited. This is the GPU kernel: compiled, it skips those blocks, so packed
  sequences and windows cost less than causal attention.
- ``DenseDocuments``: the same mask as a bool (B, 1, Sq, Sk) tensor for SDPA. Only for the CPU, where
  FlexAttention has no backward (torch 2.11), and as the reference the tests compare with.
- ``FlexDocuments(backend="FLASH")`` (``"flex_flash"``): the same block mask run by flash-attn-4's CuTe kernels
  (FlexAttention's experimental FLASH backend, forward and backward; Hopper and Blackwell; the ``flash`` extra),
  where the Triton flex kernel measured ~2.8x slower per visited block than cuDNN's causal kernel at head dim 64
  (session 12: backward 18.1 ms at a block share of 0.20 against cuDNN's 31.9 ms for all of them).
``CausalAttention(documents="auto")`` picks flex on CUDA tensors and dense on CPU ones. Without documents and
without a window, sinks or softcap, plain causal attention stays SDPA's causal kernel (flash / cuDNN).
``prepare(None, window=W)`` cannot know the sequence length, so that mask is built at each call from the
queries' length (cheap on the CPU; a GPU caller that knows the length passes one-document ids, e.g.
``torch.zeros_like(position_ids_BS)``, to build the block mask once per micro-batch instead).

Why flex rather than ``torch.nn.attention.varlen.varlen_attn`` (cu_seqlens, flash): flex was measured faster than
causal SDPA once documents are shorter than the sequence (issue 18's H200 table); varlen takes the tokens as one
flat (T, H, D) batch, not the (B, H, S, D) the blocks produce, and its API documents one head count for q, k and
v (GQA would expand K/V); a block mask is one builder for one device and for every context-parallel chunk pair.
``bench/attention_packed.py`` times both; another kernel would be one more class with ``mask``/``attend``.
Numbers: docs/packed-documents.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mmtrain.utils.optional import FLASH_PACKAGE, flash_available

FLEX_BLOCK = 128  # FlexAttention's default tile; the block mask is built at this granularity


def check_window(window: Any) -> int | None:
    """A sliding window as ``prepare`` takes it: None (no window) or a positive int."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"attention window must be None or a positive int (keys a query sees), got {window!r}")
    return window


class LengthMask(NamedTuple):
    """What ``prepare(None, window=W)`` returns: causal attention in a window W, no documents; the mask is built
    at the call from the queries' and keys' lengths (``prepare`` has no tensor to read them from)."""

    window: int | None


# ------------------------------------------------------------------------------------------ dense reference
def document_causal_mask(doc_ids_BS: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean (B, 1, S, S) mask, True where query i may attend key j: j <= i, both in the same document and,
    with a window, i - j < window. The dense reference (CPU kernel, tests); the GPU never builds it."""
    return dense_document_mask(doc_ids_BS, doc_ids_BS, 0, window)


def dense_causal_mask(Q: int, K: int, q_offset: int, window: int | None, device) -> torch.Tensor:
    """Bool (Q, K): query i (at key position ``i + q_offset``) sees key j iff j <= i + offset and, with a
    window, i + offset - j < window."""
    distance = torch.arange(Q, device=device)[:, None] + q_offset - torch.arange(K, device=device)[None, :]
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def dense_document_mask(q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int,
                        window: int | None = None) -> torch.Tensor:
    """Bool (B, 1, Q, K): query i (at position ``i + q_offset`` of the keys) attends key j iff j <= i + offset,
    they share a document id and, with a window, i + offset - j < window."""
    causal = dense_causal_mask(q_ids_BQ.shape[1], kv_ids_BK.shape[1], q_offset, window, q_ids_BQ.device)
    return ((q_ids_BQ[:, :, None] == kv_ids_BK[:, None, :]) & causal)[:, None]


def dense_attention_with_lse(q, k, v, mask: torch.Tensor, scale: float | None, softcap: float | None = None):
    """Masked attention (B, H, Q, D) and its log-sum-exp (B, H, Q) in fp32 math, differentiable in both; rows
    without any attended key give 0 and -inf. ``softcap`` c: scores c·tanh(score/c) after scaling. The ring's
    CPU reference block kernel and the dense kernel's path for sinks and softcap (K/V heads may be fewer)."""
    if q.shape[1] != k.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all-masked rows: exp(-inf) = 0, no NaN
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    safe_total = total.clamp_min(torch.finfo(total.dtype).tiny)
    out = (weights / safe_total) @ v.float()
    lse = torch.where(total > 0, torch.log(safe_total) + top, torch.full_like(top, float("-inf")))
    return out.to(q.dtype), lse.squeeze(-1)


def apply_sinks(out_BHQD: torch.Tensor, lse_BHQ: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink) per head: out·Z/(Z + e^sink) with Z = e^lse,
    i.e. out·sigmoid(lse − sink) (a row without keys, lse = -inf, gives 0)."""
    weight = torch.sigmoid(lse_BHQ.float() - sinks_H.float()[None, :, None])
    return (out_BHQD.float() * weight[..., None]).to(out_BHQD.dtype)


class DenseDocuments:
    """Document / window masks as dense bool tensors for SDPA (CPU and the tests' reference)."""

    name = "dense"

    def mask(self, q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int, window: int | None = None):
        return dense_document_mask(q_ids_BQ, kv_ids_BK, q_offset, window)

    def causal_mask(self, Q: int, K: int, q_offset: int, window: int | None, device) -> torch.Tensor:
        """The mask without documents, (1, 1, Q, K): broadcast over the batch."""
        return dense_causal_mask(Q, K, q_offset, window, device)[None, None]

    def attend(self, q, k, v, mask: torch.Tensor, scale: float | None, sinks_H: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if sinks_H is None and softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        out, lse = dense_attention_with_lse(q, k, v, mask, scale, softcap)
        return out if sinks_H is None else apply_sinks(out, lse, sinks_H)

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
    """(count, indices) in BlockMask's layout: per query block, the kept key blocks first, in order. Both
    contiguous: flex's kernels read them as if they were, and a sort keeps its input's strides (the transposed
    keep matrices of the backward's side gave transposed indices, and wrong gradients)."""
    keep = keep_BQK[:, None]
    indices = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return keep.sum(-1, dtype=torch.int32).contiguous(), indices.contiguous()


def document_block_mask(q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int, block: int = FLEX_BLOCK,
                        window: int | None = None):
    """FlexAttention ``BlockMask`` for the rule of ``dense_document_mask``, from per-block id ranges only.

    A key block can hold an attended key only if it starts at or before the query block's last position, ends
    after its first position minus the window, and the two id ranges overlap (true for any ids, sorted or not:
    a shared id lies in both ranges). It is *full* (no per-element mask) when both blocks hold one and the same
    id, the key block ends at or before the query block's first position and starts less than a window before
    the query block's last position."""
    return _block_mask(q_ids_BQ, kv_ids_BK, q_offset, block, window, documents=True)


def causal_block_mask(Q: int, K: int, q_offset: int, block: int, window: int | None, device):
    """The block mask of ``dense_causal_mask`` (no documents), batch 1: broadcast over the batch."""
    q_ids, kv_ids = (torch.zeros(1, n, dtype=torch.int32, device=device) for n in (Q, K))
    return _block_mask(q_ids, kv_ids, q_offset, block, window, documents=False)


def _block_mask(q_ids_BQ, kv_ids_BK, q_offset: int, block: int, window: int | None, documents: bool):
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
    some_visible = k_first[None, :] <= q_last[:, None]
    all_visible = k_last[None, :] <= q_first[:, None]
    if window is not None:
        some_visible = some_visible & (q_first[:, None] - k_last[None, :] < window)
        all_visible = all_visible & (q_last[:, None] - k_first[None, :] < window)
    one_doc = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
               & (q_min[:, :, None] == k_min[:, None, :]))
    full = overlap & all_visible[None] & one_doc
    partial = overlap & some_visible[None] & ~full
    kv_num, kv_idx = _ordered_blocks(partial)
    full_num, full_idx = _ordered_blocks(full)
    # the backward's key-block-major side from the transposed keep matrices: what ``BlockMask.from_kv_blocks``
    # rebuilds through a vmapped dense scatter, in a quarter of the ops (mask building is host time per
    # micro-batch: issue #32's packed row)
    q_num, q_idx = _ordered_blocks(partial.transpose(1, 2))
    full_q_num, full_q_idx = _ordered_blocks(full.transpose(1, 2))

    def visible(b, h, q_idx, kv_idx):
        distance = q_idx + q_offset - kv_idx
        keep = distance >= 0
        if window is not None:
            keep = keep & (distance < window)
        if documents:
            keep = keep & (q_ids_BQ[b, q_idx] == kv_ids_BK[b, kv_idx])
        return keep

    return BlockMask(seq_lengths=(Q, K), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                     full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(block, block), mask_mod=visible)


class FlexDocuments:
    """Document / window masks as FlexAttention block masks. Outside a compiled region the kernel is this
    object's own compiled ``flex_attention`` (eager flex would materialize the scores); inside one, dynamo
    inlines it into the block's graph. ``backend``: FlexAttention's ``"TRITON"`` kernels or ``"FLASH"``
    (flash-attn-4's CuTe kernels for the same block mask, mask_mod and score_mod)."""

    def __init__(self, block: int = FLEX_BLOCK, backend: str = "TRITON") -> None:
        if backend not in ("TRITON", "FLASH"):
            raise ValueError(f"FlexAttention backend must be 'TRITON' or 'FLASH', got {backend!r}")
        self.block = block
        self.name = "flex" if backend == "TRITON" else "flex_flash"
        # the default (None) for Triton: its kernels and configs exactly as before the FLASH option existed
        self.kernel_options = None if backend == "TRITON" else {"BACKEND": backend}
        self._compiled = None

    def mask(self, q_ids_BQ: torch.Tensor, kv_ids_BK: torch.Tensor, q_offset: int, window: int | None = None):
        return document_block_mask(q_ids_BQ, kv_ids_BK, q_offset, self.block, window)

    def causal_mask(self, Q: int, K: int, q_offset: int, window: int | None, device):
        """The block mask without documents (batch 1: broadcast over the batch)."""
        return causal_block_mask(Q, K, q_offset, self.block, window, device)

    def attend(self, q, k, v, mask, scale: float | None, sinks_H: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        score_mod = None
        if softcap is not None:
            # a captured 0-d tensor, not a Python float: a float closure turns into an unbacked symbol that flex's
            # tracing refuses once dynamo has seen a second value (torch 2.11)
            cap = torch.full((), softcap, dtype=torch.float32, device=q.device)

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)
        gqa = q.shape[1] != k.shape[1]
        options = self.kernel_options
        if sinks_H is None:
            return self._kernel(q)(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa,
                                   kernel_options=options)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = self._kernel(q)(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa,
                                   return_aux=AuxRequest(lse=True), kernel_options=options)
        return apply_sinks(out, aux.lse, sinks_H)

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
                                   return_aux=AuxRequest(lse=True), kernel_options=self.kernel_options)
        return out, aux.lse


def document_kernel(name: str, device: torch.device):
    """``"flex"``, ``"flex_flash"``, ``"dense"``, or ``"auto"``: flex on CUDA, dense where flex has no backward
    (CPU). ``"flex_flash"`` needs flash-attn-4 and a Hopper or Blackwell GPU (its CuTe kernels')."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "dense"
    if name == "flex":
        return FlexDocuments()
    if name == "flex_flash":
        check_flash(device)
        return FlexDocuments(backend="FLASH")
    if name == "dense":
        return DenseDocuments()
    raise ValueError(f"document attention kernel must be 'auto', 'flex', 'flex_flash' or 'dense', got {name!r}")


def check_flash(device: torch.device) -> None:
    """One-line refusals of ``flex_flash`` where its kernels cannot run: not CUDA, no flash-attn-4, a GPU older
    than Hopper (flash-attn-4's CuTe kernels are written for compute capability 9.0 and later)."""
    what = "document attention flex_flash (FlexAttention's FLASH backend)"
    if device.type != "cuda":
        raise ValueError(f"{what} runs on CUDA GPUs only, not {device.type}; use flex or dense")
    if not flash_available():
        raise ValueError(f"{what} needs {FLASH_PACKAGE}: pip install 'mmtrain[flash]' (or use flex)")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"{what} needs a Hopper or Blackwell GPU (compute capability >= 9.0), this one is "
                         f"{major}.{minor}; use flex")


# ------------------------------------------------------------------------------------------ strategies
class CausalAttention:
    """A decoder's attention: SDPA's causal kernel (flash/cuDNN on GPU) without documents, window, sinks or
    softcap; otherwise the document kernel ``documents`` names (``"auto"``, ``"flex"``, ``"dense"``, or a kernel
    object)."""

    def __init__(self, documents: Any = "auto") -> None:
        self.documents = documents
        self._kernels: dict[str, Any] = {}  # one kernel object per device type: compiled blocks guard on it

    def kernel_for(self, device: torch.device):
        if not isinstance(self.documents, str):
            return self.documents
        if device.type not in self._kernels:
            self._kernels[device.type] = document_kernel(self.documents, device)
        return self._kernels[device.type]

    def prepare(self, doc_ids_BS: torch.Tensor | None, window: int | None = None) -> Any:
        """Once per micro-batch and window: None (plain causal), ``LengthMask(window)`` (no documents: the mask
        is built per call) or ``(kernel, mask)`` for these document ids and this window."""
        window = check_window(window)
        if doc_ids_BS is None:
            return None if window is None else LengthMask(window)
        if window is not None and window >= doc_ids_BS.shape[1]:
            window = None  # every key of the sequence is inside the window
        kernel = self.kernel_for(doc_ids_BS.device)
        return kernel, kernel.mask(doc_ids_BS, doc_ids_BS, 0, window)

    def __call__(self, q, k, v, prepared: Any, scale: float | None = None, sinks_H: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        if prepared is None or isinstance(prepared, LengthMask):
            window = None if prepared is None else prepared.window
            if window is not None and window >= k.shape[2]:
                window = None  # every key is inside the window
            if window is None and sinks_H is None and softcap is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      enable_gqa=q.shape[1] != k.shape[1])
            kernel = self.kernel_for(q.device)
            Q, K = q.shape[2], k.shape[2]
            return kernel.attend(q, k, v, kernel.causal_mask(Q, K, K - Q, window, q.device), scale, sinks_H, softcap)
        kernel, mask = prepared
        return kernel.attend(q, k, v, mask, scale, sinks_H, softcap)


def refuse_window_sinks_softcap(what: str, window=None, sinks_H=None, softcap=None) -> None:
    """The context-parallel strategies' refusal: their chunk calls implement plain causal / document masks only."""
    for name, value in (("a sliding window", window), ("attention sinks", sinks_H), ("softcap", softcap)):
        if value is not None:
            raise ValueError(f"{what} does not support {name}; run with parallel.cp=1")


class BidirectionalAttention:
    """An encoder's (ViT, audio) full attention; ``prepared`` is an optional bool key mask (True = attend)."""

    def prepare(self, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        return attn_mask

    def __call__(self, q, k, v, prepared: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prepared, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
