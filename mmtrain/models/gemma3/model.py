"""Gemma 3 text decoder for one device (or one pipeline stage): local sliding-window and global layers.

What differs from the Llama family, each as transformers' ``Gemma3ForCausalLM`` computes it:

- RMSNorm scales by ``1 + weight`` (the stored weight starts at zero), in fp32, cast back after the scaling.
  Every block has four: before and after attention, before and after the MLP (the post-norms act on the
  branch's output, before the residual add). Queries and keys get one per head too (before RoPE).
- The embedding is multiplied by sqrt(hidden_size) rounded to the embedding's dtype.
- Local layers attend a window (query i sees keys i - sliding_window < j <= i) with RoPE base
  ``rope_local_base_freq``; global layers are causal with RoPE base ``rope_theta`` (optionally linearly scaled).
  The model prepares one mask per distinct window per micro-batch (``prepare(doc_ids, window=W)``) and hands
  each layer its own, so packed documents and windows compose (window ∩ document).
- Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; optional tanh soft-capping of the scores
  (``attn_logit_softcapping``) and of the final logits (``final_logit_softcapping``).
- The MLP is GeGLU: ``down(gelu_tanh(gate) * up)`` with one fused [gate | up] projection.

Parameter names follow the Llama family's where the piece is the same (``embed``, ``layers.<global i>``,
``attn_norm``, ``attn.qkv`` [q | k | v], ``attn.q_norm``/``k_norm``, ``attn.proj``, ``mlp_norm``, ``mlp.up``
[gate | up], ``mlp.down``, ``norm``, ``output``) plus ``post_attn_norm`` and ``post_mlp_norm``; ``spec.py`` places
each. Sizes are read off the weights in ``forward``, so the TP plan's sharded linears drop in.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.config.schema import ModelConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.model.head import LossHead
from mmtrain.model.kv_cache import StaticKVCache, cached_attention, decoded_rows
from mmtrain.model.layers import apply_rope, compile_prenorm_block, rope_cos_sin, rope_frequencies, set_prenorm_recompute
from mmtrain.model.lora import add_lora_at, reset_dora_magnitudes
from mmtrain.model.mlp import MLP
from mmtrain.models.contract import LanguageStageDefaults
from mmtrain.models.gemma3.config import Gemma3Config
from mmtrain.models.gemma3.spec import LORA_LINEARS, gemma3_sharding_spec

_OUTPUT_PROJECTIONS = ("attn.proj.weight", "mlp.down.weight")  # write into the residual stream: init scaled down


class GemmaRMSNorm(nn.Module):
    """RMSNorm times ``1 + weight`` in fp32, cast back to the input's dtype after the scaling (Gemma's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GeGLU(MLP):
    """The shared MLP (fused [gate | up] projection, selective recompute of the activation) gated by GELU with
    the tanh approximation (HF's ``gelu_pytorch_tanh``) instead of SiLU."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__(ModelConfig(hidden_size=hidden_size, ffn_hidden_size=width, activation="swiglu",
                                     add_bias=False))
        self.activation = "geglu"

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3Attention(nn.Module):
    """Fused-qkv attention with per-head q/k norms before RoPE; ``window``: None (causal) or the sliding window.
    The kernel is the ``attention`` strategy (``mmtrain.model.attention``)."""

    def __init__(self, cfg: Gemma3Config, window: int | None, attention) -> None:
        super().__init__()
        self.head_dim = hd = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.qkv.part_sizes = (self.q_size, self.kv_size, self.kv_size)  # read by the TP plan
        self.proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.window = window
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.attention = attention

    def project(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of this rank's heads, each (B, S, heads, head_dim): q/k normalized, then rotated."""
        qkv = self.qkv(x_BSD)
        B, S = qkv.shape[:2]  # under sequence parallelism the projection gathered the whole sequence
        total = self.q_size + 2 * self.kv_size
        q_local, kv_local = qkv.shape[-1] * self.q_size // total, qkv.shape[-1] * self.kv_size // total
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in qkv.split((q_local, kv_local, kv_local), dim=-1))
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """``attn_mask``: what the strategy's ``prepare`` made for this layer's window and the micro-batch."""
        q, k, v = self.project(x_BSD, cos, sin)
        B, S = q.shape[:2]
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, scale=self.scale,
                             softcap=self.softcap)
        return self.proj(out.transpose(1, 2).reshape(B, S, -1))

    def forward_cached(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                       layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
                       kv_len: int | None) -> torch.Tensor:
        """``forward`` with the cached attention core: the new keys/values of rows ``slots_B`` go into ``cache`` at
        ``positions_BS``; queries attend the cached keys their position and this layer's window allow."""
        q, k, v = self.project(x_BSD, cos, sin)
        B, S = q.shape[:2]
        cache.write(layer, slots_B, positions_BS, k, v)
        keys, values = cache.read(layer, slots_B, kv_len)
        out = cached_attention(q, keys, values, cache.key_index[: keys.shape[2]], positions_BS, scale=self.scale,
                               window=self.window, softcap=self.softcap)
        return self.proj(out.reshape(B, S, -1))


class Gemma3Block(nn.Module):
    """Attention and GeGLU MLP, each between a pre-norm and a post-norm, each added to the residual stream."""

    def __init__(self, cfg: Gemma3Config, layer: int, attention) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = GemmaRMSNorm(d, eps)
        self.attn = Gemma3Attention(cfg, cfg.window(layer), attention)
        self.post_attn_norm = GemmaRMSNorm(d, eps)
        self.mlp_norm = GemmaRMSNorm(d, eps)
        self.mlp = GeGLU(d, cfg.intermediate_size)
        self.post_mlp_norm = GemmaRMSNorm(d, eps)
        self.recompute = "none"  # "full": keep only the block's input and recompute the rest in backward

    def set_recompute(self, mode: str) -> None:
        """The family contract's recompute setting (``mmtrain.models.contract.FamilyBlock``)."""
        set_prenorm_recompute(self, mode)

    def compile_parts(self, scope: str) -> None:
        """The family contract's compile hook (``mmtrain.models.contract.FamilyBlock``): a dense block."""
        compile_prenorm_block(self, scope, routed=False)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))

    def _forward(self, x, cos, sin, attn_mask):
        return self._mlp(x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, attn_mask)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask=None) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, attn_mask, use_reentrant=False)
        return self._forward(x, cos, sin, attn_mask)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, layer: int,
               slots_B: torch.Tensor | None, positions_BS: torch.Tensor, kv_len: int | None) -> torch.Tensor:
        """The family contract's cached forward of the block: the attention through ``cache``, the rest as
        ``forward``."""
        attn = self.attn.forward_cached(self.attn_norm(x), cos, sin, cache, layer, slots_B, positions_BS, kv_len)
        return self._mlp(x + self.post_attn_norm(attn))


def global_rope_frequencies(cfg: Gemma3Config) -> torch.Tensor:
    """The global layers' inverse frequencies: base ``rope_theta``, divided by the factor under linear scaling."""
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    return inv_freq / cfg.rope_scaling_factor if cfg.rope_scaling == "linear" else inv_freq


class Gemma3Model(LanguageStageDefaults, nn.Module):
    """Gemma 3 text LM, or one pipeline stage of it (``layer_range`` of global layer indices; the first stage
    embeds, the last normalizes, projects, soft-caps and computes per-token losses). ``attention``: the strategy
    every layer shares (default ``CausalAttention()``), asked once per window per micro-batch; ``lora``: a
    ``LoraConfig`` with rank > 0 and its targets resolved adds adapters and freezes the rest. Call
    ``init_weights``."""

    def __init__(self, cfg: Gemma3Config, layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True, attention=None, moe_dispatch=None, lora=None) -> None:
        super().__init__()
        if moe_dispatch is not None:
            raise ValueError("the gemma3 family has no mixture-of-experts layers: moe_dispatch must be None")
        self.cfg = cfg.check()
        start, end = layer_range or (0, cfg.num_layers)
        self.layer_range, self.pre_process, self.post_process = (start, end), pre_process, post_process
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if pre_process else None
        self.attention = attention if attention is not None else CausalAttention()
        self.layers = nn.ModuleDict({str(i): Gemma3Block(cfg, i, self.attention) for i in range(start, end)})
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post_process else None
        own_output = post_process and not (cfg.tie_word_embeddings and pre_process)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_output else None
        self.head = LossHead() if post_process else None  # the TP plan swaps in its vocab-parallel head
        self.sequence_parallel = False  # the layout a TP plan applied (resolves the spec's partial gradients)
        # sqrt(hidden_size) in fp32, cast to the embedding's dtype when used (as HF's buffer is)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32), persistent=False)
        self.register_buffer("inv_freq_local", rope_frequencies(cfg.head_dim, cfg.rope_local_base_freq),
                             persistent=False)
        self.register_buffer("inv_freq_global", global_rope_frequencies(cfg), persistent=False)
        self.lora = lora if lora is not None and lora.rank else None
        if self.lora is not None:
            add_lora_at(self, [f"layers.{i}.{LORA_LINEARS[t]}" for i in range(start, end) for t in self.lora.targets],
                        self.lora.rank, self.lora.alpha, self.lora.dora)

    def sharding_spec(self):
        """How every tensor of the whole model is sharded (``mmtrain.models.gemma3.spec``), for this layout."""
        return gemma3_sharding_spec(self.cfg, self.lora).for_layout(self.sequence_parallel)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-tensor init keyed by (seed, name): any stage split gets the same values. Norm weights
        start at zero (a scale of one), output projections at std / sqrt(2 * num_layers); LoRA's ``B`` at zero and
        DoRA magnitudes at their weights' row norms (the adapted model starts as the base)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            seed_name = "embed.weight" if name == "output.weight" and self.cfg.tie_word_embeddings else name
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(seed_name.encode()))
            if name.endswith("lora_B.weight") or p.ndim == 1:
                p.zero_()
            elif name.endswith("lora_A.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                scale = std / (2 * self.cfg.num_layers) ** 0.5 if name.endswith(_OUTPUT_PROJECTIONS) else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        reset_dora_magnitudes(self)

    # ------------------------------------------------------------------------------------------ forward
    def embed_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The embedding times sqrt(hidden_size) rounded to its dtype (what HF's scaled embedding computes)."""
        x = self.embed(tokens_BS)
        return x * self.embed_scale.to(x.dtype)

    def rotary(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, ...]]:
        """cos/sin by layer kind (True: local) for the kinds this stage holds."""
        local = {self.cfg.window(int(i)) is not None for i in self.layers}
        return {is_local: rope_cos_sin(position_ids_BS, self.inv_freq_local if is_local else self.inv_freq_global,
                                       dtype) for is_local in local}

    def _masks(self, doc_ids_BS: torch.Tensor | None, position_ids_BS: torch.Tensor) -> dict:
        """What the attention strategy prepares for each distinct window of this stage (None: causal), once per
        micro-batch, outside the compiled blocks. Without documents a windowed mask is asked for one document
        (ids of zeros): the strategy then builds it once here, not in every layer's call."""
        out = {}
        for window in sorted({self.cfg.window(int(i)) for i in self.layers}, key=lambda w: w or 0):
            if window is None:
                out[None] = self.attention.prepare(doc_ids_BS)
            else:
                ids = doc_ids_BS if doc_ids_BS is not None else torch.zeros_like(position_ids_BS)
                out[window] = self.attention.prepare(ids, window=window)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer (soft-capped when the config says) on the normalized hidden states: this rank's
        vocabulary shard under TP (the cap is elementwise)."""
        logits = self.head.logits(x, self.output_weight())
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, inputs: torch.Tensor, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (B, S) on the first stage, hidden states (B, S, D) otherwise. Returns per-token
        losses (B, S) when ``labels_BS`` is given on the last stage, else logits (last stage) or hidden states.
        ``doc_ids_BS``: document of each token of packed sequences (attention stays inside documents)."""
        x = self.embed_tokens(inputs) if self.pre_process else inputs
        if position_ids_BS is None:
            if not self.pre_process:
                raise ValueError("a pipeline stage without the embedding needs position_ids_BS")
            B, S = inputs.shape[:2]  # token ids: the whole sequence even when x holds a sequence-parallel slice
            position_ids_BS = torch.arange(S, device=x.device).expand(B, S)
        rotary = self.rotary(position_ids_BS, x.dtype)
        masks = self._masks(doc_ids_BS, position_ids_BS)
        for i, layer in self.layers.items():
            window = self.cfg.window(int(i))
            x = layer(x, *rotary[window is not None], masks[window])
        if not self.post_process:
            return x
        logits = self.logits(self.head.prepare(self.norm(x)))
        return self.head.full_logits(logits) if labels_BS is None else self.head.loss(logits, labels_BS)

    # ------------------------------------------------------------------------------------------ decoding
    def new_kv_cache(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> StaticKVCache:
        """The family contract's cache for ``decode``: keys and values of this rank's KV heads for every layer
        (local layers too: their window is a mask over the same rows)."""
        attn = next(iter(self.layers.values())).attn
        kv_local = attn.qkv.weight.shape[0] * attn.kv_size // (attn.q_size + 2 * attn.kv_size)
        return StaticKVCache(len(self.layers), slots, kv_local // attn.head_dim, max_len, attn.head_dim, dtype, device)

    def decode(self, cache: StaticKVCache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
               last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The family contract's cached forward of the whole model: fp32 logits (B, V) of one position per row
        (``last_index_B``, default the last), the new tokens' keys/values stored in ``cache``. ``inputs_embeds``
        are used as given (not scaled), as HF does."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(tokens_BS)
        rotary = self.rotary(positions_BS, x.dtype)
        for c, (i, layer) in enumerate(self.layers.items()):
            x = layer.decode(x, *rotary[self.cfg.window(int(i)) is not None], cache, c, slots_B, positions_BS, kv_len)
        x = self.head.prepare(self.norm(decoded_rows(x, last_index_B)))
        return self.head.full_logits(self.logits(x))[:, 0].float()
