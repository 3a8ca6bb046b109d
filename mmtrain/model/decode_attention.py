"""A decode step's attention as one Triton kernel: RoPE on the new query and key, the new key and value written
into the cache, and every query head's attention over its row's cached positions up to its own.

The compiled decode step otherwise runs, per layer, Inductor's kernels for the query's RoPE, the key's RoPE with
its cache write, the value's cache write and the mask, then cuDNN's attention over every cached position (the
static shape attends all ``max_len`` positions, masked) and a copy after it: six launches, ~11 us at Llama-3.2-1B
shapes on the H200 (bench/results/h200_2026-12-04_s22.md). Here one program takes one row's query heads of one
KV head (grouped-query attention reads each key once for the group), stops at the row's position, so a short
sequence in a long cache reads only its own keys, and handles the new key from registers: no program reads the
position being written, so the write needs no ordering. With few rows the positions are split in chunks over more
programs (flash-decoding), each writing its running max, sum and weighted values, which a second small kernel
merges in a fixed order (deterministic; no buffer to zero: CUDA-graph safe).

RoPE, the cache write and the attention round as the unfused decode step does: the rotated query and key in
fp32, rounded once to the cache's dtype (as Inductor's fused kernel does); scores, softmax and sums in fp32, the
probabilities rounded to the value dtype for the product with V (as flash kernels do).

``decode_attention`` is a ``triton_op`` mutating the two cache tensors, so torch.compile traces it and the decode
step's CUDA graphs capture it. ``kv_cache.one_token_kernel_applies`` says when the decode step takes it (plain causal
attention of one new token in every slot, on a GPU); everything else keeps ``kv_cache.cached_attention``.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; a CPU-only install may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None

SMS = 132  # the H100/H200's streaming multiprocessors: the split aims at about as many programs
MIN_CHUNK = 128  # positions per program at least: a smaller split costs more (the merge) than it saves


def supported(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel takes: a power-of-two head dim from 32 to 256 (halves of at least 16 for ``tl.dot``),
    query heads a multiple of the KV heads, a 16-bit float cache."""
    return (triton is not None and 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and heads % kv_heads == 0 and dtype in (torch.bfloat16, torch.float16))


def block_for(head_dim: int) -> int:
    """Cached positions per loop step: 128 (the H200's best at head dim 64), 64 at head dim 256 (two stages of
    key and value tiles must fit in shared memory)."""
    return 128 if head_dim <= 128 else 64


def chunk_for(rows: int, kv_heads: int, max_len: int, block_t: int = 128) -> int:
    """Cached positions per program, a multiple of ``block_t``: the whole cache when rows x KV heads fill the
    GPU's ``SMS`` already, else split for about twice as many programs (flash-decoding), never fewer than
    ``MIN_CHUNK`` positions. On the H200 at Llama-3.2-1B heads (bench/decode_attention.py, session 22): one row
    over 392 positions took 4.6 us in chunks of 128, 5.7 in one; over 4096, 5.3-6.1 us in chunks of 128, 6.0-6.5
    in 256; 32 rows took 7.8-7.9 us in one program each, 9.3-10.5 split."""
    programs = rows * kv_heads
    if programs >= SMS:
        return -(-max_len // block_t) * block_t
    per = -(-max_len // -(-2 * SMS // programs))
    return max(MIN_CHUNK, -(-per // block_t) * block_t)


if triton is not None:
    from mmtrain.model.fp8_gemv import to_bf16

    @triton.jit
    def _rounded(x, IS_BF16: tl.constexpr, dtype):
        """fp32 -> the cache's 16-bit dtype, to nearest (bf16 through ``to_bf16``: exact under the interpreter)."""
        if IS_BF16:
            return to_bf16(x)
        return x.to(dtype)

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr,
                                 part_ptr, ml_ptr, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, T, chunk, splits,
                                 SCALE: tl.constexpr,
                                 KVH: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                                 HAS_ROPE: tl.constexpr, IS_BF16: tl.constexpr, MERGED: tl.constexpr,
                                 BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        HALF: tl.constexpr = D // 2
        pos = tl.load(pos_ptr + b)
        dl = tl.arange(0, HALF)
        g = tl.arange(0, M_PAD)
        g_ok = g < G
        heads = kvh * G + g
        q_rows = q_ptr + b * sq_b + heads[:, None] * sq_h + dl[None, :]
        q_lo = tl.load(q_rows, mask=g_ok[:, None], other=0.0).to(tl.float32)
        q_hi = tl.load(q_rows + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
        k_lo = tl.load(k_ptr + b * sk_b + kvh * sk_h + dl).to(tl.float32)
        k_hi = tl.load(k_ptr + b * sk_b + kvh * sk_h + HALF + dl).to(tl.float32)
        if HAS_ROPE:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x_hi, x_lo)
            c_lo = tl.load(cos_ptr + b * D + dl).to(tl.float32)
            c_hi = tl.load(cos_ptr + b * D + HALF + dl).to(tl.float32)
            s_lo = tl.load(sin_ptr + b * D + dl).to(tl.float32)
            s_hi = tl.load(sin_ptr + b * D + HALF + dl).to(tl.float32)
            q_lo, q_hi = q_lo * c_lo[None, :] - q_hi * s_lo[None, :], q_hi * c_hi[None, :] + q_lo * s_hi[None, :]
            k_lo, k_hi = k_lo * c_lo - k_hi * s_lo, k_hi * c_hi + k_lo * s_hi
        dtype = kc_ptr.dtype.element_ty
        q_lo, q_hi = _rounded(q_lo, IS_BF16, dtype), _rounded(q_hi, IS_BF16, dtype)  # once, as the cache's key
        k_lo, k_hi = _rounded(k_lo, IS_BF16, dtype), _rounded(k_hi, IS_BF16, dtype)
        v_new = tl.load(v_ptr + b * sv_b + kvh * sv_h + tl.arange(0, D))
        row = (b * KVH + kvh).to(tl.int64) * T * D  # this row's KV head in the (slots, KVH, T, D) caches
        # one program writes the new key and value; none reads that position (below). A position past the cache
        # (the engine never decodes one) writes nothing and reads only the cache: no access outside it
        inside = (split == 0) & (pos < T)
        tl.store(kc_ptr + row + pos * D + dl, k_lo, mask=inside & (dl < HALF))
        tl.store(kc_ptr + row + pos * D + HALF + dl, k_hi, mask=inside & (dl < HALF))
        tl.store(vc_ptr + row + pos * D + tl.arange(0, D), v_new.to(dtype), mask=inside & (tl.arange(0, D) < D))
        lo = split * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, pos), T)  # cached keys before the row's own position
        own = (pos >= lo) & (pos < lo + chunk)  # this chunk holds the new key: taken from registers
        qk_scale: tl.constexpr = SCALE * 1.4426950408889634  # exp2 below
        s_new = (tl.sum(q_lo.to(tl.float32) * k_lo.to(tl.float32)[None, :], axis=1)
                 + tl.sum(q_hi.to(tl.float32) * k_hi.to(tl.float32)[None, :], axis=1)) * qk_scale
        m = tl.where(own, s_new, float("-inf"))
        l_sum = tl.where(own, 1.0, 0.0) + tl.zeros([M_PAD], tl.float32)
        acc = tl.where(own, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([M_PAD, D], tl.float32)
        for t0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):  # the row's own length, not the cache's
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < hi
            keys = kc_ptr + row + t[:, None] * D + dl[None, :]
            kt_lo = tl.load(keys, mask=ok[:, None], other=0.0)
            kt_hi = tl.load(keys + HALF, mask=ok[:, None], other=0.0)
            vals = tl.load(vc_ptr + row + t[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q_lo, tl.trans(kt_lo)) + tl.dot(q_hi, tl.trans(kt_hi))
            s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_next = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_next)
            p = tl.exp2(s - m_next[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(_rounded(p, IS_BF16, dtype), vals)
            m = m_next
        if not MERGED:
            out = out_ptr + (b * KVH * G + heads[:, None]) * D + tl.arange(0, D)[None, :]
            tl.store(out, _rounded(acc / l_sum[:, None], IS_BF16, dtype), mask=g_ok[:, None])
        else:  # partials (B, H, SPLITS, D) and (B, H, SPLITS, 2): merged by _merge_kernel
            slot = (b * KVH * G + heads) * splits + split
            tl.store(part_ptr + slot[:, None] * D + tl.arange(0, D)[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + slot * 2, m, mask=g_ok)
            tl.store(ml_ptr + slot * 2 + 1, l_sum, mask=g_ok)

    @triton.jit
    def _merge_kernel(part_ptr, ml_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                      SPLITS_PAD: tl.constexpr, IS_BF16: tl.constexpr):
        head = tl.program_id(0)  # b * H + h
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < SPLITS
        m = tl.load(ml_ptr + (head * SPLITS + s) * 2, mask=s_ok, other=float("-inf"))
        l_sum = tl.load(ml_ptr + (head * SPLITS + s) * 2 + 1, mask=s_ok, other=0.0)
        top = tl.max(m, axis=0)  # finite: the chunk holding the new key has a score
        w = tl.exp2(m - top)  # empty chunks: m = -inf, weight 0
        acc = tl.load(part_ptr + (head * SPLITS + s)[:, None] * D + tl.arange(0, D)[None, :],
                      mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + head * D + tl.arange(0, D), _rounded(out, IS_BF16, out_ptr.dtype.element_ty))

    def _traced(kernel):
        """The kernel as torch.compile traces it; under TRITON_INTERPRET=1 (the CPU tests) ``triton.jit``
        returns an interpreted function, which ``wrap_triton`` refuses: then the plain function."""
        interpreted = not isinstance(kernel, triton.runtime.jit.JITFunction)
        return kernel if interpreted else torch.library.wrap_triton(kernel)

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
               sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
               chunk: int, block_t: int = 128, warps: int = 4, stages: int = 2) -> torch.Tensor:
        """The kernel(s) with ``chunk`` positions per program (the bench tries several; a multiple of
        ``block_t``); see ``decode_attention``."""
        B, _, H, D = q.shape
        KVH, T = k_cache.shape[1], k_cache.shape[2]
        G = H // KVH
        splits = triton.cdiv(T, chunk)
        out = torch.empty((B, 1, H, D), device=q.device, dtype=q.dtype)
        part = torch.empty((B, H, splits, D) if splits > 1 else (1,), device=q.device, dtype=torch.float32)
        ml = torch.empty((B, H, splits, 2) if splits > 1 else (1,), device=q.device, dtype=torch.float32)
        has_rope, is_bf16 = cos is not None, k_cache.dtype == torch.bfloat16
        cos_arg, sin_arg = (cos, sin) if has_rope else (q, q)  # any pointer: not read without HAS_ROPE
        _traced(_decode_attention_kernel)[(B, KVH, splits)](
            q, k, v, cos_arg, sin_arg, k_cache, v_cache, positions, out, part, ml,
            q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), T, chunk, splits,
            SCALE=D ** -0.5, KVH=KVH, G=G, M_PAD=max(16, triton.next_power_of_2(G)), D=D, HAS_ROPE=has_rope,
            IS_BF16=is_bf16, MERGED=splits > 1, BLOCK_T=block_t, STAGES=stages, num_warps=warps)
        if splits > 1:
            _traced(_merge_kernel)[(B * H,)](part, ml, out, D=D, SPLITS=splits,
                                             SPLITS_PAD=triton.next_power_of_2(splits), IS_BF16=is_bf16, num_warps=1)
        return out

    @torch.library.triton_op("mmtrain::decode_attention", mutates_args=("k_cache", "v_cache"))
    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                         sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
        """One new token per row: ``q`` (B, 1, H, D), ``k``/``v`` (B, 1, KV heads, D) before RoPE (the last dim
        contiguous; views of the fused projection are fine), ``cos``/``sin`` (B, 1, 1, D) contiguous or None (no
        RoPE), caches (B, KV heads, T, D) contiguous, ``positions`` (B, 1) int64. Writes the rotated key and the
        value at each row's position and returns the attention (B, 1, H, D) of each query over its row's
        positions 0..position."""
        block_t = block_for(q.shape[3])
        return launch(q, k, v, cos, sin, k_cache, v_cache, positions.contiguous(),
                      chunk_for(q.shape[0], k_cache.shape[1], k_cache.shape[2], block_t), block_t)
