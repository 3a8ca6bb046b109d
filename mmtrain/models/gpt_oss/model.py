"""GPT-OSS decoder for one device (or one pipeline stage): attention with sinks and sliding windows, MoE layers.

Attention: fused [q | k | v] projection and output projection, both with biases (``attention_bias``); grouped
query heads of an explicit ``head_dim``; RoPE on the whole head (halves rotated, as HF), with YaRN frequencies and
YaRN's cos/sin factor computed exactly as transformers 5.24's ``_compute_yarn_parameters`` does for the config's
values; scale 1/sqrt(head_dim). Each query head has a learned sink logit (``attn.sinks``) that joins the softmax
denominator only: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}). Layers are ``sliding_attention`` (the
query sees itself and the ``sliding_window - 1`` keys before it) or ``full_attention`` (``cfg.layer_types``).
The kernel is the shared attention strategy (``mmtrain.model.attention``): ``prepare(doc_ids, window)`` once per
distinct window per micro-batch, each layer handed its own; decoding attends the cache through the shared
``cached_attention`` with the layer's window and sinks.

Every layer is a mixture of experts (``moe.py``). Norms are RMSNorm (weights in the parameters' dtype, as
``F.rms_norm``), embeddings untied (``tie_word_embeddings`` is honoured if a config sets it).

Parameter names follow the other families (``embed``, ``layers.<global i>``, ``attn_norm``, ``attn.qkv``,
``attn.proj``, ``attn.sinks``, ``mlp_norm``, ``mlp.router``, ``mlp.experts.w_up/b_up/w_down/b_down``, ``norm``,
``output``); ``spec.py`` says how each is sharded. Sizes are read off the weights in ``forward``, so TP-sharded
linears (and a TP rank's slice of the sinks) drop in.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.model.attention import CausalAttention
from mmtrain.model.head import LossHead
from mmtrain.model.kv_cache import StaticKVCache, cached_attention, decoded_rows
from mmtrain.model.layers import RMSNorm, apply_rope, compile_prenorm_block, set_prenorm_recompute
from mmtrain.model.lora import add_lora_at, reset_dora_magnitudes
from mmtrain.model.moe import Experts
from mmtrain.models.contract import LanguageStageDefaults
from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.models.gpt_oss.moe import GptOssMoE
from mmtrain.models.gpt_oss.spec import LORA_LINEARS, gpt_oss_sharding_spec
from mmtrain.parallel.moe_dispatch import LocalDispatch

# projections writing into the residual stream: initialized smaller (1/sqrt(2 * num_layers))
_OUTPUT_PROJECTIONS = ("attn.proj.weight", "experts.w_down")


# --------------------------------------------------------------------------------------------- rotary
def rope_inv_freq(cfg: GptOssConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in fp32 with transformers' operations in its order (default or YaRN:
    extrapolated above ``yarn_beta_fast`` rotations, interpolated by ``yarn_factor`` below ``yarn_beta_slow``,
    a linear ramp between, the correction range rounded only with ``yarn_truncate``)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    if cfg.rope_scaling != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return (dim * math.log(cfg.yarn_original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (cfg.yarn_factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_cos_sin(position_ids_BS: torch.Tensor, inv_freq: torch.Tensor, factor: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, S, 1, head_dim) of the positions, both halves alike (``layers.apply_rope``'s layout), times
    YaRN's factor in fp32 before the cast (as transformers)."""
    angles = position_ids_BS.float()[..., None] * inv_freq.to(position_ids_BS.device)
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


# ------------------------------------------------------------------------------------------ attention
class SinkAttention(nn.Module):
    """GQA self-attention with biases and a sink logit per query head; ``window``: this layer's sliding window
    (None: full); the kernel is the shared ``attention`` strategy."""

    def __init__(self, cfg: GptOssConfig, window: int | None, attention=None) -> None:
        super().__init__()
        self.head_dim, self.window = cfg.head_dim, window
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.qkv.part_sizes = (self.q_size, self.kv_size, self.kv_size)  # [q | k | v], read by the TP plan
        self.proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention if attention is not None else CausalAttention()

    def project(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, S, this rank's heads, head_dim), RoPE applied to q and k."""
        qkv = self.qkv(x_BSD)
        B, S = qkv.shape[:2]  # the whole sequence: under sequence parallelism the projection gathered it
        total = self.q_size + 2 * self.kv_size  # a TP shard holds each part / tp: split in the same proportion
        q_local, kv_local = qkv.shape[-1] * self.q_size // total, qkv.shape[-1] * self.kv_size // total
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in qkv.split((q_local, kv_local, kv_local), dim=-1))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prepared=None) -> torch.Tensor:
        """``prepared``: what the strategy's ``prepare`` made for this layer's window and the micro-batch."""
        q, k, v = self.project(x_BSD, cos, sin)
        B, S = q.shape[:2]
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), prepared, scale=self.scale,
                             sinks_H=self.sinks.float())
        return self.proj(out.transpose(1, 2).reshape(B, S, -1))

    def forward_cached(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                       layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
                       kv_len: int | None) -> torch.Tensor:
        """``project``, the new keys/values written to ``cache``, attention over the cached ones (window, sinks)."""
        q, k, v = self.project(x_BSD, cos, sin)
        B, S = q.shape[:2]
        cache.write(layer, slots_B, positions_BS, k, v)
        keys, values = cache.read(layer, slots_B, kv_len)
        out = cached_attention(q, keys, values, cache.key_index[: keys.shape[2]], positions_BS, scale=self.scale,
                               window=self.window, sinks_H=self.sinks.float())
        return self.proj(out.reshape(B, S, -1))


# ---------------------------------------------------------------------------------------------- model
class DecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(attn_norm(x)), then + moe(mlp_norm(x))."""

    def __init__(self, cfg: GptOssConfig, index: int, attention=None, moe_dispatch: LocalDispatch | None = None):
        super().__init__()
        self.window = cfg.window(index)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = SinkAttention(cfg, self.window, attention)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, moe_dispatch)
        self.recompute = "none"  # "full": keep only the layer's input and recompute the rest in backward

    def set_recompute(self, mode: str) -> None:
        """The family contract's recompute setting: ``full`` checkpoints the layer (``selective`` keeps all: its
        MLP is MoE)."""
        set_prenorm_recompute(self, mode)

    def compile_parts(self, scope: str) -> None:
        """The family contract's compile hook: the dense parts (norms, attention); the MoE stays eager."""
        compile_prenorm_block(self, scope, routed=True)

    def _forward(self, x, cos, sin, prepared):
        x = x + self.attn(self.attn_norm(x), cos, sin, prepared)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, cos, sin, prepared=None):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, prepared, use_reentrant=False)
        return self._forward(x, cos, sin, prepared)

    def decode(self, x, cos, sin, cache: StaticKVCache, layer: int, slots_B, positions_BS, kv_len):
        """The family contract's cached forward of the layer: the attention through ``cache``, the rest as
        ``forward``."""
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, cache, layer, slots_B, positions_BS, kv_len)
        return x + self.mlp(self.mlp_norm(x))


class GptOssModel(LanguageStageDefaults, nn.Module):
    """GPT-OSS LM, or one pipeline stage of it (``layer_range`` of global layer indices; the first stage embeds,
    the last normalizes, projects and computes per-token losses; ``attention``: the strategy every layer shares,
    default ``CausalAttention()``; ``moe_dispatch``: the MoE layers' token dispatch, default local; ``lora``: a
    ``LoraConfig`` with rank > 0 adapts its targets (empty: ``qkv`` and ``proj``) and freezes the rest). Call
    ``init_weights``."""

    def __init__(self, cfg: GptOssConfig, layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True, attention=None, moe_dispatch: LocalDispatch | None = None,
                 lora=None) -> None:
        super().__init__()
        self.cfg = cfg.check()
        start, end = layer_range or (0, cfg.num_layers)
        self.layer_range, self.pre_process, self.post_process = (start, end), pre_process, post_process
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if pre_process else None
        self.attention = attention if attention is not None else CausalAttention()
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, self.attention, moe_dispatch)
                                     for i in range(start, end)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post_process else None
        own_output = post_process and not (cfg.tie_word_embeddings and pre_process)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_output else None
        self.head = LossHead() if post_process else None  # the TP plan swaps in its vocab-parallel head
        self.sequence_parallel = False
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.lora_targets: tuple[str, ...] = ()
        self.dora = False
        if lora is not None and lora.rank:
            self.lora_targets, self.dora = tuple(lora.targets or cfg.lora_targets()), lora.dora
            add_lora_at(self, [f"layers.{i}.{LORA_LINEARS[t]}" for i in range(start, end) for t in self.lora_targets],
                        lora.rank, lora.alpha, lora.dora)

    def sharding_spec(self):
        """How every tensor of the whole model is sharded (``mmtrain.models.gpt_oss.spec``), for this layout."""
        return gpt_oss_sharding_spec(self.cfg, self.lora_targets, self.dora).for_layout(self.sequence_parallel)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-parameter init keyed by (seed, name): any stage split gets the same values. Matrices
        normal(init_std) (output projections / sqrt(2 * num_layers); experts drawn whole, then this rank's slice),
        norms one, biases and sinks zero; LoRA's ``B`` zero, ``A`` normal / sqrt(in), DoRA magnitudes the row
        norms (the adapted model starts as the base)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith(("bias", "b_up", "b_down", "sinks", "lora_B.weight")):
                p.zero_()
            elif name.endswith("lora_A.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            else:
                if name == "output.weight" and self.cfg.tie_word_embeddings:  # a tied copy starts as the embedding
                    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(b"embed.weight"))
                scale = std / (2 * self.cfg.num_layers) ** 0.5 if name.endswith(_OUTPUT_PROJECTIONS) else std
                owner = self.get_submodule(name.rpartition(".")[0])
                if isinstance(owner, Experts):  # this rank's experts of the whole model's values
                    p.copy_(owner.own_slice(torch.randn((owner.num_total, *p.shape[1:]), generator=g) * scale))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        reset_dora_magnitudes(self)

    def rotary(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(position_ids_BS, self.inv_freq, self.cfg.yarn_attention_factor(), dtype)

    def forward(self, inputs: torch.Tensor, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (B, S) on the first stage, hidden states (B, S, D) otherwise. Returns per-token
        losses (B, S) with ``labels_BS`` on the last stage, else logits (last stage) or hidden states.
        ``doc_ids_BS``: document of each token of packed sequences (attention stays inside documents)."""
        if position_ids_BS is None:
            if not self.pre_process:
                raise ValueError("a pipeline stage without the embedding needs position_ids_BS")
            B, S = inputs.shape[:2]  # the whole sequence (under sequence parallelism hidden states are a slice)
            position_ids_BS = torch.arange(S, device=inputs.device).expand(B, S)
        x = self.embed(inputs) if self.pre_process else inputs
        cos, sin = self.rotary(position_ids_BS, x.dtype)
        # once per distinct window and micro-batch, outside the compiled layers; without packed documents the whole
        # sequence is one document, so the (window) masks are built here once rather than by every layer's call
        ids = doc_ids_BS if doc_ids_BS is not None else torch.zeros_like(position_ids_BS)
        prepared = {w: self.attention.prepare(ids, window=w)
                    for w in dict.fromkeys(layer.window for layer in self.layers.values())}
        for layer in self.layers.values():
            x = layer(x, cos, sin, prepared[layer.window])
        if not self.post_process:
            return x
        x = self.head.prepare(self.norm(x))
        logits = self.logits(x)
        return self.head.full_logits(logits) if labels_BS is None else self.head.loss(logits, labels_BS)

    def new_kv_cache(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> StaticKVCache:
        """The family contract's cache for ``decode``: keys and values of this rank's KV heads for every layer
        (a sliding layer's too: its window is a mask over the same rows)."""
        attn = next(iter(self.layers.values())).attn
        kv_local = attn.qkv.weight.shape[0] * attn.kv_size // (attn.q_size + 2 * attn.kv_size)
        return StaticKVCache(len(self.layers), slots, kv_local // attn.head_dim, max_len, attn.head_dim, dtype,
                             device)

    def decode(self, cache: StaticKVCache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
               last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The family contract's cached forward: fp32 logits (B, V) of one position per row (``last_index_B``,
        default the last), the new tokens' keys and values stored in ``cache``."""
        x = inputs_embeds if inputs_embeds is not None else self.embed(tokens_BS)
        cos, sin = self.rotary(positions_BS, x.dtype)
        for i, layer in enumerate(self.layers.values()):
            x = layer.decode(x, cos, sin, cache, i, slots_B, positions_BS, kv_len)
        x = self.head.prepare(self.norm(decoded_rows(x, last_index_B)))
        return self.head.full_logits(self.logits(x))[:, 0].float()
