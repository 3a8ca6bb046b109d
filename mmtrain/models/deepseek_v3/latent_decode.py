"""The cached attention core of multi-head latent attention (``LatentAttention``): what the family's cached
forward (``DeepseekV3Model.decode``, the family contract's decoding member) runs instead of the training core.

What is cached: per token the normalized KV latent and the rotated shared RoPE key (``LatentKVCache``,
``kv_lora_rank + qk_rope_head_dim`` numbers for all heads), not the expanded per-head keys and values
(``heads * (qk_nope + qk_rope + v)`` numbers): 71x less for DeepSeek-V3's shape (576 vs 40,960 per token and
layer), which is the point of MLA. A decode step then attends in the latent space, as DeepSeek's inference does:
``k_nope = W_uk c`` and ``v = W_uv c`` are linear in the latent ``c``, so ``q_nope . k_nope = (W_uk^T q_nope) . c``
-- the key up-projection is folded into each query -- and ``sum_t p_t v_t = W_uv (sum_t p_t c_t)`` -- the value
up-projection is applied once to the attention output. Every cached position then costs one dot product of
``kv_lora_rank + qk_rope_head_dim`` per head and nothing is expanded per step; the result equals the expanded
attention up to rounding. A prefill (many queries over the prompt's own positions) expands the prompt's keys and
values once with the model's ``attn.expand`` and runs SDPA, as training does: its fused kernels never hold the
(heads x prompt x prompt) scores that the latent-space form would. Queries, latent and RoPE key come from the
model's own ``attn.project``, the up-projections from ``attn.expand`` / ``attn.up_weights`` (this rank's heads
under tensor parallelism; the latent, computed by the replicated ``kv_down``, is the same on every rank), so
nothing of the projection is copied here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.model.kv_cache import LatentKVCache


def latent_cache_for(model: nn.Module, slots: int, max_len: int, dtype: torch.dtype,
                     device: torch.device | str) -> LatentKVCache:
    """A latent cache for a DeepSeek-V3-style model: one (latent | RoPE key) entry per token and layer."""
    cfg = next(iter(model.layers.values())).attn.cfg
    return LatentKVCache(len(model.layers), slots, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, device)


def cached_latent_attention(attn: nn.Module, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            cache: LatentKVCache, layer: int, slots_B: torch.Tensor | None,
                            positions_BS: torch.Tensor, kv_len: int | None) -> torch.Tensor:
    """``attn`` (a ``LatentAttention``) on new tokens at ``positions_BS``: their latents and RoPE keys into the
    cache, queries attending every cached position up to their own (a decode step in the latent space, a
    prefill on expanded keys/values: the module docstring)."""
    q_nope, q_rope, latent, k_rope = attn.project(x_BSD, cos, sin)
    B, S = q_nope.shape[:2]
    rank = latent.shape[-1]
    cache.write(layer, slots_B, positions_BS, torch.cat((latent[:, :, None], k_rope), dim=-1))
    entries = cache.read(layer, slots_B, kv_len).to(q_nope.dtype)  # (B, 1, T, rank + rope): keys of all heads
    visible = cache.key_index[: entries.shape[2]][None, None, None, :] <= positions_BS[:, None, :, None]
    if S > 1:  # a prefill: the prompt's keys/values expanded (attn.expand), SDPA's fused kernels, as in training
        k_nope, v = attn.expand(entries[:, 0, :, :rank])
        heads, T = q_nope.shape[2], entries.shape[2]
        k = torch.cat((k_nope, entries[:, 0, :, None, rank:].expand(B, T, heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=visible, scale=attn.softmax_scale)  # (B, H, S, v)
        return attn.proj(out.transpose(1, 2).reshape(B, S, -1))
    # a decode step: attention in the latent space, one latent "head" for all query heads (broadcast by matmul);
    # the values are a view of the keys' first `rank` columns (SDPA on the CPU is ~500x slower with such a
    # strided value than this)
    w_uk, w_uv = attn.up_weights()  # (H, nope, rank), (H, v, rank)
    q_latent = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)
    q = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # (B, H, 1, rank + rope)
    scores = (q @ entries.transpose(-1, -2)).float() * attn.softmax_scale  # (B, H, 1, T)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).to(q.dtype)
    out = torch.einsum("bhsr,hvr->bshv", probs @ entries[..., :rank], w_uv)
    return attn.proj(out.reshape(B, S, -1))
