"""Nemotron-H hybrid decoder for one device (or one pipeline stage): Mamba-2, attention and MLP layers by pattern.

Each layer is ``x + mixer(norm(x))`` (transformers' ``NemotronHBlock``), its mixer by the layer's letter of
``hybrid_override_pattern``:

- ``M``: the Mamba-2 mixer (``mixer.py``; the SSD scan in ``ssd.py``);
- ``*``: self-attention with the shared fused-qkv ``Attention`` and the run's attention strategy, *without*
  positional embeddings (Nemotron-H's attention has no RoPE: position reaches it through the Mamba layers);
  scores scaled by head_dim ** -0.5, GQA;
- ``-``: an MLP ``down(relu(up(x))^2)``, no gate.

RMSNorms compute in fp32 and multiply by the weight before casting back (transformers' ``NemotronHRMSNorm``).
Packed documents (``doc_ids_BS``) confine all three kinds: the attention mask, the Mamba convolution and its
scan's state. Parameter names: ``embed``, ``layers.<global i>.norm``, ``layers.<i>.mixer.*`` (the Mamba mixer's
as transformers names them; attention ``qkv`` [q | k | v] and ``proj``; MLP ``up`` and ``down``), ``norm``,
``output``; ``spec.py`` places each.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.config.schema import ModelConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.model.head import LossHead
from mmtrain.model.kv_cache import decoded_rows
from mmtrain.model.layers import Attention
from mmtrain.model.lora import add_lora_at, reset_dora_magnitudes
from mmtrain.model.mlp import MLP
from mmtrain.models.contract import LanguageStageDefaults, check_compile_scope, check_recompute_mode
from mmtrain.models.nemotron_h.config import ATTENTION, LORA_LINEARS, MAMBA, NemotronHConfig
from mmtrain.models.nemotron_h.decode import HybridStateCache, mamba_decode, new_state_cache
from mmtrain.models.nemotron_h.mixer import Mamba2Mixer
from mmtrain.models.nemotron_h.spec import nemotron_h_sharding_spec
from mmtrain.models.nemotron_h.ssd import at_least_fp32

# the projections that write into the residual stream: scaled down at init under rescale_prenorm_residual
_OUTPUT_PROJECTIONS = ("mixer.out_proj.weight", "mixer.proj.weight", "mixer.down.weight")


class NemotronHRMSNorm(nn.Module):
    """RMSNorm in fp32, times the weight in fp32, cast back to the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(at_least_fp32(x), (x.shape[-1],), at_least_fp32(self.weight), self.eps).to(x.dtype)


class Relu2MLP(MLP):
    """The shared MLP (``up``, ``down``; selective recompute of the activation) with relu(x)^2 and no gate."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__(ModelConfig(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                                     activation="gelu", add_bias=cfg.mlp_bias))  # "gelu": the non-gated layout
        self.activation = cfg.mlp_hidden_act

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(h))


def attention_block_config(cfg: NemotronHConfig) -> ModelConfig:
    """The shared ``Attention``'s shape: heads, GQA groups, the explicit head width, no biases."""
    return ModelConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                       num_query_groups=cfg.num_key_value_heads, head_dim=cfg.head_dim)


class NemotronHBlock(nn.Module):
    """One layer: pre-norm, its mixer (``kind``: mamba, attention or mlp), residual add."""

    def __init__(self, cfg: NemotronHConfig, kind: str, attention) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg)
        elif kind == ATTENTION:
            self.mixer = Attention(attention_block_config(cfg), attention)
        else:
            self.mixer = Relu2MLP(cfg)
        self.recompute = "none"  # "full": keep only the block's input and recompute the rest in backward

    def set_recompute(self, mode: str) -> None:
        """The family contract's recompute setting: ``selective`` recomputes an MLP layer's activation (the other
        kinds keep everything), ``full`` the whole layer."""
        check_recompute_mode(mode)
        self.recompute = mode
        if isinstance(self.mixer, MLP):
            self.mixer.recompute_activation = mode == "selective"

    def compile_parts(self, scope: str) -> None:
        """The family contract's compile hook: the whole layer, its call's inside (hooks on the call stay eager),
        or only the norm when the linears are not traceable."""
        check_compile_scope(scope)
        if scope == "no_linears":
            self.norm.compile()
        elif scope == "inside_call":
            self.forward = torch.compile(self.forward)
        else:
            self.compile()

    def _forward(self, x: torch.Tensor, attn_mask, doc_ids_BS: torch.Tensor | None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == MAMBA:
            return x + self.mixer(h, doc_ids_BS)
        if self.kind == ATTENTION:
            return x + self.mixer(h, None, None, attn_mask)  # no cos/sin: no positional embedding
        return x + self.mixer(h)

    def forward(self, x: torch.Tensor, attn_mask=None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_mask``: what the attention strategy prepared for the micro-batch; ``doc_ids_BS``: the packed
        documents (the Mamba mixer's convolution and scan stay inside them)."""
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attn_mask, doc_ids_BS, use_reentrant=False)
        return self._forward(x, attn_mask, doc_ids_BS)

    def decode(self, x: torch.Tensor, cos, sin, cache: HybridStateCache, layer: int, slots_B: torch.Tensor | None,
               positions_BS: torch.Tensor, kv_len: int | None,
               last_index_B: torch.Tensor | None = None) -> torch.Tensor:
        """The family contract's cached forward (``layer``: this block's index among the cache's layers of its
        kind): a Mamba mixer continues its recurrent state (``decode.mamba_decode``; ``last_index_B``: where each
        row's real tokens end, so padding leaves the state alone), attention goes through the KV cache (no
        cos/sin: no positional embedding), an MLP is as in ``forward``."""
        h = self.norm(x)
        if self.kind == MAMBA:
            return x + mamba_decode(self.mixer, h, cache, layer, slots_B, positions_BS, last_index_B)
        if self.kind == ATTENTION:
            return x + self.mixer.forward_cached(h, None, None, cache, layer, slots_B, positions_BS, kv_len)
        return x + self.mixer(h)


class NemotronHModel(LanguageStageDefaults, nn.Module):
    """Nemotron-H LM, or one pipeline stage of it (``layer_range`` of global layer indices, anywhere in the pattern;
    the first stage embeds, the last normalizes, projects and computes per-token losses). ``attention``: the
    strategy the attention layers share (default ``CausalAttention()``), prepared once per micro-batch; ``lora``:
    a ``LoraConfig`` with rank > 0 and its targets resolved adds adapters and freezes the rest. Call
    ``init_weights``."""

    def __init__(self, cfg: NemotronHConfig, layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True, attention=None, moe_dispatch=None, lora=None) -> None:
        super().__init__()
        if moe_dispatch is not None:
            raise ValueError("the nemotron_h family has no mixture-of-experts layers: moe_dispatch must be None")
        self.cfg = cfg.check()
        start, end = layer_range or (0, cfg.num_layers)
        self.layer_range, self.pre_process, self.post_process = (start, end), pre_process, post_process
        kinds = cfg.layer_kinds()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if pre_process else None
        self.attention = attention if attention is not None else CausalAttention()
        self.layers = nn.ModuleDict({str(i): NemotronHBlock(cfg, kinds[i], self.attention) for i in range(start, end)})
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon) if post_process else None
        own_output = post_process and not (cfg.tie_word_embeddings and pre_process)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_output else None
        self.head = LossHead() if post_process else None  # the TP plan swaps in its vocab-parallel head
        self.sequence_parallel = False  # the layout a TP plan applied (resolves the spec's partial gradients)
        self.lora = lora if lora is not None and lora.rank else None
        if self.lora is not None:
            add_lora_at(self, [f"layers.{i}.{LORA_LINEARS[t][1]}" for i in range(start, end) for t in self.lora.targets
                               if LORA_LINEARS[t][0] == kinds[i]], self.lora.rank, self.lora.alpha, self.lora.dora)

    def sharding_spec(self):
        """How every tensor of the whole model is sharded (``mmtrain.models.nemotron_h.spec``), for this layout."""
        return nemotron_h_sharding_spec(self.cfg, self.lora).for_layout(self.sequence_parallel)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-tensor init keyed by (seed, name): any stage split gets the same values. Linears and
        the embedding normal(initializer_range), the residual-writing projections scaled by 1/sqrt(num_layers)
        (``rescale_prenorm_residual``); norms one, biases zero; the convolution uniform in +-1/sqrt(kernel) (torch's
        default bound); Mamba's ``A_log = log(1..H)``, ``D = 1`` and ``dt_bias`` the inverse softplus of a dt drawn
        log-uniformly in [time_step_min, time_step_max] (at least time_step_floor), as transformers initializes
        them. LoRA's ``B`` zero, DoRA magnitudes the weights' row norms."""
        cfg = self.cfg
        for name, p in self.named_parameters():
            seed_name = "embed.weight" if name == "output.weight" and cfg.tie_word_embeddings else name
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(seed_name.encode()))
            leaf = name.rpartition(".")[2]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.shape[0] + 1, dtype=torch.float32)))
            elif leaf == "D":
                p.fill_(1.0)
            elif leaf == "dt_bias":
                low, high = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
                dt = torch.exp(torch.rand(p.shape, generator=g) * (high - low) + low).clamp(min=cfg.time_step_floor)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            elif name.endswith("lora_B.weight") or leaf == "bias":
                p.zero_()
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            elif name.endswith("lora_A.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name.endswith("conv1d.weight"):
                bound = p.shape[-1] ** -0.5
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
            else:
                std = cfg.initializer_range
                if cfg.rescale_prenorm_residual and name.endswith(_OUTPUT_PROJECTIONS):
                    std /= math.sqrt(cfg.num_layers)
                p.copy_(torch.randn(p.shape, generator=g) * std)
        reset_dora_magnitudes(self)

    def forward(self, inputs: torch.Tensor, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (B, S) on the first stage, hidden states (B, S, D) otherwise. Returns per-token
        losses (B, S) when ``labels_BS`` is given on the last stage, else logits (last stage) or hidden states.
        ``position_ids_BS`` is not used (no positional embedding); ``doc_ids_BS``: document of each token of packed
        sequences (attention, convolution and scan stay inside documents)."""
        x = self.embed(inputs) if self.pre_process else inputs
        attn_mask = None
        if any(layer.kind == ATTENTION for layer in self.layers.values()):
            attn_mask = self.attention.prepare(doc_ids_BS)  # once per micro-batch, outside the compiled blocks
        for layer in self.layers.values():
            x = layer(x, attn_mask, doc_ids_BS)
        if not self.post_process:
            return x
        logits = self.logits(self.head.prepare(self.norm(x)))
        return self.head.full_logits(logits) if labels_BS is None else self.head.loss(logits, labels_BS)

    # ------------------------------------------------------------------------------------------ decoding
    def new_kv_cache(self, slots: int, max_len: int, dtype: torch.dtype,
                     device: torch.device | str) -> HybridStateCache:
        """The family contract's decoding cache (``decode.HybridStateCache``): per Mamba layer its convolution and
        scan states (constant in ``max_len``), per attention layer its keys and values, sized for this rank."""
        return new_state_cache(list(self.layers.values()), slots, max_len, dtype, device)

    def decode(self, cache: HybridStateCache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
               last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The family contract's cached forward of the whole model: fp32 logits (B, V) of one position per row
        (``last_index_B``, default the last); the Mamba layers' states and the attention layers' keys/values of
        the new tokens stored in ``cache``. A row whose first position is 0 starts a new sequence."""
        x = inputs_embeds if inputs_embeds is not None else self.embed(tokens_BS)
        seen: dict[str, int] = {}  # layers of each kind so far: a layer's index among the cache's of its kind
        for layer in self.layers.values():
            index = seen.get(layer.kind, 0)
            x = layer.decode(x, None, None, cache, index, slots_B, positions_BS, kv_len, last_index_B)
            seen[layer.kind] = index + 1
        x = self.head.prepare(self.norm(decoded_rows(x, last_index_B)))
        return self.head.full_logits(self.logits(x))[:, 0].float()
