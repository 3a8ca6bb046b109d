"""The forward pass of a decoder-only LM (the Llama family's ``GPTModel``, the DeepSeek-V3 family's
``DeepseekV3Model``) with a static KV cache.

It reuses the model's own modules — embedding, norms, the fused qkv and output projections, q/k norms, RoPE
frequencies, MLP or MoE layer, head — and only replaces the attention core: new keys/values go into the cache
at each row's positions and queries attend the cached keys up to their own position. So it runs whatever the
model's modules are: whole, or sharded by the tensor-parallel plan (column/row linears do their collectives,
the vocab-parallel head gathers full logits), in fp32 or bf16. The training attention core is not touched.
Multi-head latent attention (DeepSeek-V3) caches latents instead of keys and values and attends in the latent
space: ``mmtrain.inference.latent_decoder``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.inference.kv_cache import LatentKVCache, StaticKVCache
from mmtrain.inference.latent_decoder import cached_latent_attention, latent_cache_for
from mmtrain.model.layers import rope_cos_sin


class UnsupportedModelError(ValueError):
    """A model this decoder cannot run (a pipeline stage, another family); the message says what it needs."""


def _latent(model: nn.Module) -> bool:
    """Whether the layers use multi-head latent attention (a ``kv_down`` latent projection: DeepSeek-V3)."""
    return hasattr(next(iter(model.layers.values())).attn, "kv_down")


def check_decodable(model: nn.Module) -> None:
    """Raise ``UnsupportedModelError`` unless ``model`` is a whole Llama-family ``GPTModel`` or DeepSeek-V3-family
    ``DeepseekV3Model``."""
    needed = ("embed", "layers", "norm", "head", "inv_freq", "logits")
    if not all(getattr(model, n, None) is not None for n in needed) or not len(model.layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: KV-cache decoding needs a whole Llama- or DeepSeek-V3-family model "
            "(embedding, layers, final norm and head on one rank: no pipeline stages)")
    if any(not (hasattr(layer.attn, "qkv") or hasattr(layer.attn, "kv_down")) for layer in model.layers.values()):
        raise UnsupportedModelError(f"{type(model).__name__}: the layers have neither a fused qkv projection nor "
                                    "a latent kv_down one (the Llama and DeepSeek-V3 families decode with a cache)")


def kv_cache_for(model: nn.Module, slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> StaticKVCache | LatentKVCache:
    """A cache sized for ``model`` as it is on this rank (its qkv projection's local width: a TP shard's heads;
    a latent attention's latent width, the same on every rank)."""
    if _latent(model):
        return latent_cache_for(model, slots, max_len, dtype, device)
    kv_heads, head_dim = _kv_heads_and_dim(model)
    return StaticKVCache(len(model.layers), slots, kv_heads, max_len, head_dim, dtype, device)


def kv_cache_bytes(model: nn.Module, slots: int, max_len: int, dtype: torch.dtype) -> int:
    """The bytes ``kv_cache_for`` allocates for these sizes (computed, nothing allocated)."""
    if _latent(model):
        cfg = next(iter(model.layers.values())).attn.cfg
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        kv_heads, head_dim = _kv_heads_and_dim(model)
        per_layer = 2 * kv_heads * head_dim  # keys and values
    return len(model.layers) * per_layer * slots * max_len * dtype.itemsize


def _kv_heads_and_dim(model: nn.Module) -> tuple[int, int]:
    """This rank's key/value heads (from its qkv projection's local width) and the head dim."""
    layer = next(iter(model.layers.values())).attn
    total = layer.q_size + 2 * layer.kv_size
    kv_local = layer.qkv.weight.shape[0] * layer.kv_size // total
    return kv_local // layer.head_dim, layer.head_dim


def _cached_attention(attn: nn.Module, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: StaticKVCache, layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
                      kv_len: int | None) -> torch.Tensor:
    """``attn``'s projections (``Attention.project``: the model's own split, q/k norm and RoPE) with a cached
    attention core: keys/values through the cache."""
    q, k, v = attn.project(x_BSD, cos, sin)
    B, S = q.shape[:2]
    cache.write(layer, slots_B, positions_BS, k, v)
    keys, values = cache.read(layer, slots_B, kv_len)
    visible = cache.key_index[: keys.shape[2]][None, None, None, :] <= positions_BS[:, None, :, None]  # (B,1,S,T)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=visible,
                                         enable_gqa=q.shape[2] != keys.shape[1])
    return attn.proj(out.transpose(1, 2).reshape(B, S, -1))


def decoder_forward(model: nn.Module, cache: StaticKVCache | LatentKVCache, positions_BS: torch.Tensor,
                    tokens_BS: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                    slots_B: torch.Tensor | None = None, last_index_B: torch.Tensor | None = None,
                    kv_len: int | None = None) -> torch.Tensor:
    """Run ``model`` on new tokens (or embeddings: a VLM's spliced prompt) of rows ``slots_B`` at ``positions_BS``,
    storing their keys/values in ``cache``. Returns fp32 logits over the whole vocabulary of one position per
    row, (B, V): ``last_index_B[b]`` (default the last column). ``kv_len``: attend only the first ``kv_len``
    cached positions (a prefill that knows its longest row; None attends all, the static decode shape)."""
    x = inputs_embeds if inputs_embeds is not None else model.embed(tokens_BS)
    if _latent(model):
        cos, sin = model.rotary(positions_BS, x.dtype)
        attend = cached_latent_attention
    else:
        cos, sin = rope_cos_sin(positions_BS, model.inv_freq, x.dtype)
        attend = _cached_attention
    for i, layer in enumerate(model.layers.values()):
        x = x + attend(layer.attn, layer.attn_norm(x), cos, sin, cache, i, slots_B, positions_BS, kv_len)
        x = x + layer.mlp(layer.mlp_norm(x))
    if last_index_B is None:
        x = x[:, -1:]
    else:
        x = x[torch.arange(x.shape[0], device=x.device), last_index_B][:, None]
    x = model.head.prepare(model.norm(x))
    return model.head.full_logits(model.logits(x))[:, 0].float()
