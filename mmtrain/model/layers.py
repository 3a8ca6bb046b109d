"""Transformer building blocks, written for one device.

Parallel plans (``mmtrain.parallel.tensor``) swap the ``nn.Linear``/``nn.Embedding`` modules for sharded
ones; the math here reads the local sizes off the weights (``view(B, S, -1, head_dim)``), so the same code
runs whole or tensor-parallel. Fused projections (``qkv``, ``gate_up``) keep one GEMM each; their weight
rows are laid out in parts ([q | k | v], [gate | up]) that the TP plan shards part by part.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.config.schema import ModelConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.model.kv_cache import (StaticKVCache, cached_attention, one_token_attention,
                                    one_token_kernel_applies)
from mmtrain.model.mlp import MLP
from mmtrain.model.moe import MoELayer
from mmtrain.models.contract import check_compile_scope, check_recompute_mode
from mmtrain.parallel.moe_dispatch import LocalDispatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.hidden_size
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


# --------------------------------------------------------------------------------------------- rotary
def rope_frequencies(head_dim: int, theta: float, scaling_factor: float = 1.0,
                     original_max_positions: int = 8192) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama-3 style scaling of the low frequencies when factor > 1.

    Computed in float32 with the same operations, in the same order, as transformers (modeling_rope_utils):
    checkpoints trained there saw those exact values, and an ulp of a frequency is a visible angle error at
    positions in the thousands (float64-then-cast differs in about a third of the values at head_dim 64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling_factor == 1.0:
        return inv_freq
    low_freq_factor, high_freq_factor = 1.0, 4.0  # Llama-3.1/3.2 constants
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


def rope_cos_sin(position_ids_BS: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (B, S, 1, head_dim) for the given absolute positions (context-parallel chunks and packed
    documents pass their own positions)."""
    angles = position_ids_BS.to(torch.float32)[..., None] * inv_freq.to(position_ids_BS.device)
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BSHD.shape[-1] // 2
    rotated = torch.cat((-x_BSHD[..., half:], x_BSHD[..., :half]), dim=-1)
    return x_BSHD * cos + rotated * sin


# ------------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    """Fused-qkv self-attention; the kernel is the ``attention`` strategy (``mmtrain.model.attention``: causal
    or document-masked for a decoder, bidirectional for an encoder, context-parallel under CP)."""

    def __init__(self, cfg: ModelConfig, attention=None) -> None:
        super().__init__()
        self.head_dim = cfg.attention_head_dim
        self.q_size = cfg.num_attention_heads * self.head_dim
        self.kv_size = cfg.kv_heads * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.add_bias or cfg.qkv_bias)
        self.qkv.part_sizes = (self.q_size, self.kv_size, self.kv_size)  # read by the TP plan
        self.proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.add_bias)
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.attention = attention if attention is not None else CausalAttention()
        self.window = cfg.sliding_window or None  # the cached attention's (decode); training's is prepared

    def project(self, x_BSD: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, each (B, S, heads on this rank, head_dim): the fused projection split by local sizes, q/k
        norm, RoPE. Shared with the cached forward (``forward_cached``)."""
        qkv = self.qkv(x_BSD)
        B, S = qkv.shape[:2]  # with sequence parallelism x_BSD holds S/tp rows; qkv is gathered to S
        # local sizes (a TP shard holds q_size/tp etc.): split in the same proportion as the full layout
        total = self.q_size + 2 * self.kv_size
        q_local = qkv.shape[-1] * self.q_size // total
        kv_local = qkv.shape[-1] * self.kv_size // total
        q, k, v = qkv.split((q_local, kv_local, kv_local), dim=-1)
        q = q.view(B, S, -1, self.head_dim)
        k = k.view(B, S, -1, self.head_dim)
        v = v.view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: positions are added to the input instead (learned / sin-cos tables)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward_cached(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                       layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
                       kv_len: int | None) -> torch.Tensor:
        """The projections of ``project`` with a cached attention core (decoding): the new keys/values of rows
        ``slots_B`` go into ``cache`` at ``positions_BS``, queries attend the cached keys up to their own
        position (the first ``kv_len`` cached positions; None: all)."""
        q, k, v = self.project(x_BSD, None, None)
        B, S = q.shape[:2]
        if one_token_kernel_applies(q, cache, slots_B, kv_len, self.window):
            out = one_token_attention(q, k, v, cos, sin, cache, layer, positions_BS)  # RoPE and the write too
        else:
            if cos is not None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(layer, slots_B, positions_BS, k, v)
            keys, values = cache.read(layer, slots_B, kv_len)
            out = cached_attention(q, keys, values, cache.key_index[: keys.shape[2]], positions_BS,
                                   window=self.window)
        return self.proj(out.reshape(B, S, -1))

    def new_kv_cache(self, num_layers: int, slots: int, max_len: int, dtype: torch.dtype,
                     device: torch.device | str) -> StaticKVCache:
        """A cache for ``num_layers`` layers like this one, as it is on this rank (its qkv projection's local
        width: a TP shard's heads)."""
        kv_local = self.qkv.weight.shape[0] * self.kv_size // (self.q_size + 2 * self.kv_size)
        return StaticKVCache(num_layers, slots, kv_local // self.head_dim, max_len, self.head_dim, dtype, device)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask=None) -> torch.Tensor:
        """``attn_mask``: what the strategy's ``prepare`` made for this micro-batch (None: plain causal)."""
        q, k, v = self.project(x_BSD, cos, sin)
        B, S = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = self.attention(q, k, v, attn_mask)
        return self.proj(out.transpose(1, 2).reshape(B, S, -1))


def set_prenorm_recompute(block: nn.Module, mode: str) -> None:
    """A pre-norm block's recompute mode (``mmtrain.models.contract.RECOMPUTE_MODES``): ``full`` checkpoints its
    whole call (``block.recompute``), ``selective`` its dense MLP's activation (an MoE MLP keeps everything)."""
    check_recompute_mode(mode)
    block.recompute = mode
    if isinstance(block.mlp, MLP):
        block.mlp.recompute_activation = mode == "selective"


def compile_prenorm_block(block: nn.Module, scope: str, routed: bool) -> None:
    """``torch.compile`` the parts of a pre-norm block (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``) that
    ``scope`` allows (``mmtrain.models.contract.COMPILE_SCOPES``); ``routed``: its MLP is an MoE layer, whose
    data-dependent token counts per expert keep it eager (the dense parts are compiled)."""
    check_compile_scope(scope)
    if scope == "no_linears":  # e.g. Transformer Engine modules: dynamo does not trace them
        block.attn_norm.compile()
        block.mlp_norm.compile()
    elif routed:
        block.attn_norm.compile()
        block.attn.compile()
        block.mlp_norm.compile()
    elif scope == "inside_call":  # hooks on the block's call (FSDP's gather/free) stay eager
        block.forward = torch.compile(block.forward)
    else:
        block.compile()


class TransformerBlock(nn.Module):
    """Pre-norm block. ``attention``: the attention strategy (default causal); an encoder block passes
    ``BidirectionalAttention()`` and keeps the same parameter layout, so the TP plan shards it the same way.
    ``moe_dispatch``: the MoE layer's token-dispatch strategy (``mmtrain.parallel.moe_dispatch``; default local)
    when ``cfg.num_experts``. ``routed``: whether this block's MLP is the MoE layer (default: the model has
    experts; a decoder passes ``cfg.moe_layer(index)``, so ``moe_dense_layers`` keep a dense MLP)."""

    def __init__(self, cfg: ModelConfig, attention=None, moe_dispatch: LocalDispatch | None = None,
                 routed: bool | None = None) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, attention)
        self.mlp_norm = make_norm(cfg)
        routed = bool(cfg.num_experts) if routed is None else routed
        self.mlp = MoELayer(cfg, moe_dispatch) if routed else MLP(cfg)
        self.recompute = "none"  # "full": keep only the block's input and recompute the rest in backward

    def set_recompute(self, mode: str) -> None:
        """The family contract's recompute setting (``mmtrain.models.contract.FamilyBlock``)."""
        set_prenorm_recompute(self, mode)

    def compile_parts(self, scope: str) -> None:
        """The family contract's compile hook (``mmtrain.models.contract.FamilyBlock``)."""
        compile_prenorm_block(self, scope, routed=isinstance(self.mlp, MoELayer))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, layer: int,
               slots_B: torch.Tensor | None, positions_BS: torch.Tensor, kv_len: int | None) -> torch.Tensor:
        """The family contract's cached forward of the block (``mmtrain.models.contract.FamilyBlock``): the
        attention through ``cache`` (``Attention.forward_cached``), the rest as ``forward``."""
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, cache, layer, slots_B, positions_BS, kv_len)
        return x + self.mlp(self.mlp_norm(x))

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn_mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask=None) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, attn_mask, use_reentrant=False)
        return self._forward(x, cos, sin, attn_mask)
