"""DeepSeek-V3-style decoder for one device (or one pipeline stage): MLA attention, sigmoid-routed MoE.

Multi-head latent attention: queries come from the hidden state directly or through a low-rank latent
(``q_down`` -> RMSNorm -> ``q_up``); keys and values from one compressed latent (``kv_down`` -> RMSNorm ->
``kv_up``, per head [k_nope | v]) plus one RoPE key head shared by all heads, produced by ``kv_down`` next to the
latent (decoupled RoPE). Query/key heads are ``qk_nope_head_dim + qk_rope_head_dim`` wide, values
``v_head_dim``; SDPA takes the two widths as they are. RoPE uses HF's layout: with ``rope_interleave`` the rope
dims are read as pairs (x0, x1), (x2, x3), ... and written back as [rotated evens | rotated odds]; queries and
keys get the same permutation, so their dot products are those of DeepSeek's complex-number rotation.

MoE layers route each token with sigmoid scores: a selection bias (``router.expert_bias``, HF's
``e_score_correction_bias``, moved by ``update_routing_biases``, never by gradients) picks the experts, groups
are ranked by the sum of their two best biased scores and only the best ``topk_group`` groups compete, the
chosen experts' *unbiased* scores (optionally normalized) times ``routed_scaling_factor`` weight their outputs.
Shared experts are one dense SwiGLU MLP added to every token. The first ``first_k_dense_replace`` layers are dense.

Parameter names follow ``mmtrain.models.llama.model`` where the piece is the same (``embed``, ``layers.<global i>``,
``attn_norm``, ``attn.proj``, ``mlp.up`` [gate | up], ``mlp.down``, ``mlp.router``, ``mlp.experts.w_up/w_down``,
``mlp.shared``, ``norm``, ``output``), so the existing TP/EP/checkpoint pieces can be pointed at them; how each
one would be sharded is ``spec.py``. Sizes are read off the weights in ``forward``, so sharded linears drop in.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.config.schema import ModelConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.model.head import LossHead
from mmtrain.model.kv_cache import LatentKVCache, decoded_rows
from mmtrain.model.layers import MLP, RMSNorm, compile_prenorm_block, set_prenorm_recompute
from mmtrain.model.lora import reset_dora_magnitudes
from mmtrain.model.moe import Experts
from mmtrain.models.deepseek_v3.config import DeepseekV3Config
from mmtrain.models.deepseek_v3.latent_decode import cached_latent_attention, latent_cache_for
from mmtrain.models.deepseek_v3.lora import add_adapters
from mmtrain.models.contract import LanguageStageDefaults, RoutedExpertsLayer
from mmtrain.models.deepseek_v3.spec import deepseek_v3_sharding_spec
from mmtrain.parallel.moe_dispatch import LocalDispatch, count_per_expert

LATENT_NORM_EPS = 1e-6  # the q/kv latent norms' epsilon in DeepSeek's and HF's code (not rms_norm_eps)
# projections writing into the residual stream (not q_down/kv_down, which also end in "down.weight")
_OUTPUT_PROJECTIONS = ("attn.proj.weight", "mlp.down.weight", "shared.down.weight", "experts.w_down")


def _swiglu_shape(cfg: DeepseekV3Config, width: int) -> ModelConfig:
    """The GPT shape that makes ``layers.MLP`` / ``moe.Experts`` a SwiGLU of this width without biases."""
    return ModelConfig(hidden_size=cfg.hidden_size, ffn_hidden_size=width, moe_ffn_hidden_size=width,
                       activation="swiglu", add_bias=False)


# --------------------------------------------------------------------------------------------- rotary
def rope_inv_freq(cfg: DeepseekV3Config) -> torch.Tensor:
    """Inverse frequencies (qk_rope_head_dim / 2,) in fp32, computed as HF does (default or YaRN)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if cfg.rope_scaling != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        boundary_period = cfg.yarn_original_max_position_embeddings / (rotations * 2 * math.pi)  # = 1/inv_freq
        return dim * math.log(boundary_period) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies unchanged), 0: interpolate by the factor
    return (1.0 / (cfg.yarn_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_cos_sin(position_ids_BS: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of one angle per rotated pair, (B, S, 1, rope_dim / 2), times YaRN's attention factor."""
    angles = position_ids_BS.float()[..., None, None] * inv_freq.to(position_ids_BS.device)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ------------------------------------------------------------------------------------------ attention
class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); the kernel is the ``attention`` strategy
    (``mmtrain.model.attention``, shared with the Llama family: it takes v_head_dim != qk_head_dim)."""

    def __init__(self, cfg: DeepseekV3Config, attention=None) -> None:
        super().__init__()
        self.cfg = cfg
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_down = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_up = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_down = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_down.part_sizes = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)  # [latent | shared rope key]
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.proj = nn.Linear(heads * cfg.v_head_dim, d, bias=False)
        self.softmax_scale = cfg.softmax_scale()
        self.attention = attention if attention is not None else CausalAttention()

    def project(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope (B, S, H, nope), q_rope (B, S, H, rope), latent (B, S, kv_lora_rank), k_rope (B, S, 1, rope)):
        the queries of this rank's H heads, the normalized KV latent and the shared RoPE key (RoPE applied).
        The latent and the RoPE key are all a token's keys and values depend on: what a KV cache keeps."""
        c = self.cfg
        q = self.q_proj(x_BSD) if c.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x_BSD)))
        B, S = q.shape[:2]  # the whole sequence: under sequence parallelism the projections gathered it
        q_nope, q_rope = q.view(B, S, -1, c.qk_head_dim).split((c.qk_nope_head_dim, c.qk_rope_head_dim), dim=-1)
        latent, k_rope = self.kv_down(x_BSD).split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, c.rope_interleave)
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, c.rope_interleave)
        return q_nope, q_rope, self.kv_norm(latent), k_rope

    def expand(self, latent_BSR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_nope (B, S, H, nope), v (B, S, H, v_head_dim)) of this rank's heads from the normalized latent."""
        c = self.cfg
        B, S = latent_BSR.shape[:2]
        kv = self.kv_up(latent_BSR).view(B, S, -1, c.qk_nope_head_dim + c.v_head_dim)
        return kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_up``'s weight per head of this rank: (H, nope, kv_lora_rank) for the keys, (H, v_head_dim,
        kv_lora_rank) for the values; what attention in the latent space folds into queries and outputs."""
        c = self.cfg
        w = self.kv_up.weight.view(-1, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask=None) -> torch.Tensor:
        q_nope, q_rope, latent, k_rope = self.project(x_BSD, cos, sin)
        k_nope, v = self.expand(latent)
        B, S, heads = q_nope.shape[:3]  # this rank's heads under TP
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # (B, H, S, qk_head_dim)
        k = torch.cat((k_nope, k_rope.expand(B, S, heads, -1)), dim=-1).transpose(1, 2)
        out = self.attention(q, k, v.transpose(1, 2), attn_mask, self.softmax_scale)  # (B, H, S, v_dim)
        return self.proj(out.transpose(1, 2).reshape(B, S, -1))


# ------------------------------------------------------------------------------------------------ MoE
class GroupLimitedRouter(nn.Module):
    """Sigmoid scores; biased selection limited to the best ``topk_group`` groups; weights from unbiased scores."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts))  # selection only, no gradient

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) fp32, expert ids (N, k))."""
        c = self.cfg
        scores = F.linear(x_ND.float(), self.weight.float()).sigmoid()
        choice = scores.detach() + self.expert_bias
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(c.topk_group, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class DeepseekMoE(nn.Module, RoutedExpertsLayer):
    """Routed experts (``moe.Experts``: w_up (E, D, 2F) [gate | up], w_down (E, F, D)) plus shared experts.
    ``dispatch``: the token-dispatch strategy (``mmtrain.parallel.moe_dispatch``, default local), which also
    runs the shared experts (so an all-to-all dispatch can overlap them with its exchange). A
    ``RoutedExpertsLayer`` (the contract's MoE layer: what the expert-parallel plan and ``update_router_biases``
    read); no balance loss (the selection bias balances)."""

    def __init__(self, cfg: DeepseekV3Config, dispatch: LocalDispatch | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.bias_update_rate = cfg.bias_update_rate
        self.dispatch = dispatch or LocalDispatch()
        self.router = GroupLimitedRouter(cfg)
        first, count = self.dispatch.expert_range(cfg.n_routed_experts)  # only this rank's experts
        self.experts = Experts(_swiglu_shape(cfg, cfg.moe_intermediate_size), count, first, cfg.n_routed_experts)
        self.shared = MLP(_swiglu_shape(cfg, cfg.shared_intermediate_size)) if cfg.n_shared_experts else None
        self.step_load: torch.Tensor | None = None  # tokens per expert since the last bias update

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights, ids = self.router(x)
        load = count_per_expert(ids.flatten(), self.num_experts)
        if self.training:  # the bias update counts training tokens only (not validation, a DPO reference or
            # decoding, where a count kept across compiled steps would hold a CUDA graph's overwritten output)
            self.step_load = load if self.step_load is None else self.step_load + load
        # (B, S, D): under sequence parallelism the shared experts' TP linears gather the sequence
        shared = (lambda x_ND: self.shared(x_ND.view_as(x_BSD))) if self.shared is not None else None
        out, shared_out = self.dispatch(x, weights, ids, self.experts, self.num_experts, None, shared)
        out = out.view_as(x_BSD)
        return out if shared_out is None else out + shared_out


# ---------------------------------------------------------------------------------------------- model
class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, index: int, attention=None,
                 moe_dispatch: LocalDispatch | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = LatentAttention(cfg, attention)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg, moe_dispatch) if cfg.is_moe_layer(index) else MLP(_swiglu_shape(cfg, cfg.intermediate_size))
        self.recompute = "none"  # "full": keep only the layer's input and recompute the rest in backward

    def set_recompute(self, mode: str) -> None:
        """The family contract's recompute setting (``mmtrain.models.contract.FamilyBlock``): selective
        recomputes a dense layer's MLP activation, nothing of an MoE layer."""
        set_prenorm_recompute(self, mode)

    def compile_parts(self, scope: str) -> None:
        """The family contract's compile hook (``mmtrain.models.contract.FamilyBlock``): an MoE layer compiles
        its dense parts only."""
        compile_prenorm_block(self, scope, routed=isinstance(self.mlp, DeepseekMoE))

    def _forward(self, x, cos, sin, attn_mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x, cos, sin, cache: LatentKVCache, layer: int, slots_B, positions_BS, kv_len):
        """The family contract's cached forward of the layer: the attention through the latent ``cache``
        (``latent_decode.cached_latent_attention``), the rest as ``forward``."""
        x = x + cached_latent_attention(self.attn, self.attn_norm(x), cos, sin, cache, layer, slots_B, positions_BS,
                                        kv_len)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, cos, sin, attn_mask=None):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, attn_mask, use_reentrant=False)
        return self._forward(x, cos, sin, attn_mask)


class DeepseekV3Model(LanguageStageDefaults, nn.Module):
    """DeepSeek-V3-style LM, or one pipeline stage of it (``layer_range`` of global layer indices; the first
    stage embeds, the last one normalizes, projects and computes per-token losses; ``attention``: the
    attention strategy every layer shares, default ``CausalAttention()``; ``moe_dispatch``: the MoE layers'
    token-dispatch strategy, default local; ``lora``: a ``LoraConfig`` with rank > 0 and its targets resolved
    adds LoRA adapters (``mmtrain.models.deepseek_v3.lora``) and freezes the rest). Call ``init_weights``."""

    def __init__(self, cfg: DeepseekV3Config, layer_range: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True, attention=None,
                 moe_dispatch: LocalDispatch | None = None, lora=None) -> None:
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
        self.sequence_parallel = False  # the layout a TP plan applied (resolves the spec's partial gradients)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.lora = lora if lora is not None and lora.rank else None
        if self.lora is not None:
            add_adapters(self, cfg, self.lora)

    def sharding_spec(self):
        """How every tensor of the whole model is sharded (``mmtrain.models.deepseek_v3.spec``)."""
        with torch.device("meta"):  # the whole model's names, whatever stage this is
            names = list(DeepseekV3Model(self.cfg, lora=self.lora).state_dict())

        return deepseek_v3_sharding_spec(self.cfg, names).for_layout(self.sequence_parallel)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-parameter init keyed by (seed, name), as ``GPTModel``: any stage split gets the same
        values. Output projections (``attn.proj``, ``down``, ``w_down``) are scaled by 1/sqrt(2 * num_layers);
        norms start at one, routing biases at zero; LoRA's ``B`` at zero and DoRA magnitudes at their weights' row
        norms (the adapted model starts as the base)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("lora_B.weight"):
                p.zero_()
                continue
            if name.endswith("lora_A.weight"):
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                continue
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            seed_name = "embed.weight" if name == "output.weight" and self.cfg.tie_word_embeddings else name
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(seed_name.encode()))
            scale = std / (2 * self.cfg.num_layers) ** 0.5 if name.endswith(_OUTPUT_PROJECTIONS) else std
            owner = self.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, Experts):  # this rank's experts of the whole model's values
                p.copy_(owner.own_slice(torch.randn((owner.num_total, *p.shape[1:]), generator=g) * scale))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        for module in self.modules():
            if isinstance(module, GroupLimitedRouter):
                module.expert_bias.zero_()
        reset_dora_magnitudes(self)  # DoRA magnitudes: the row norms of the weights just set

    def rotary(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the positions (with YaRN's attention factor), as every layer's ``attn`` takes them."""
        return rope_cos_sin(position_ids_BS, self.inv_freq, self.cfg.yarn_attention_factor(), dtype)

    def forward(self, inputs: torch.Tensor, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (B, S) on the first stage, hidden states (B, S, D) otherwise. Returns per-token
        losses (B, S) when ``labels_BS`` is given on the last stage, else logits (last stage) or hidden states.
        ``doc_ids_BS``: document of each token of packed sequences (attention stays inside documents)."""
        x = self.embed(inputs) if self.pre_process else inputs
        if position_ids_BS is None:
            B, S = x.shape[:2]
            position_ids_BS = torch.arange(S, device=x.device).expand(B, S)
        cos, sin = self.rotary(position_ids_BS, x.dtype)
        attn_mask = self.attention.prepare(doc_ids_BS)  # once per micro-batch, outside the compiled layers
        for layer in self.layers.values():
            x = layer(x, cos, sin, attn_mask)
        if not self.post_process:
            return x
        x = self.head.prepare(self.norm(x))
        logits = self.logits(x)
        return self.head.full_logits(logits) if labels_BS is None else self.head.loss(logits, labels_BS)

    def new_kv_cache(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> LatentKVCache:
        """The family contract's cache for ``decode``: per token and layer the latent and the RoPE key."""
        return latent_cache_for(self, slots, max_len, dtype, device)

    def decode(self, cache: LatentKVCache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
               last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The family contract's cached forward, as ``GPTModel.decode``: fp32 logits (B, V) of one position per
        row (``last_index_B``, default the last), the new tokens' latents stored in ``cache``."""
        x = inputs_embeds if inputs_embeds is not None else self.embed(tokens_BS)
        cos, sin = self.rotary(positions_BS, x.dtype)
        for i, layer in enumerate(self.layers.values()):
            x = layer.decode(x, cos, sin, cache, i, slots_B, positions_BS, kv_len)
        x = self.head.prepare(self.norm(decoded_rows(x, last_index_B)))
        return self.head.full_logits(self.logits(x))[:, 0].float()

    @torch.no_grad()
    def update_routing_biases(self, groups: list = ()) -> dict[str, list[int]]:
        """Auxiliary-loss-free balancing, after a step: sum each MoE layer's expert load over ``groups`` (ranks
        that routed different tokens), move its selection bias by ``bias_update_rate`` toward the mean load
        (under-used experts up, over-used down), reset the counts. Returns the loads by layer name."""
        loads = {}
        for name, module in self.named_modules():
            if not isinstance(module, DeepseekMoE) or module.step_load is None:
                continue
            load = module.step_load.float()
            for g in groups:
                if g is not None and dist.get_world_size(g) > 1:
                    dist.all_reduce(load, group=g)
            module.router.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
            loads[name] = [int(v) for v in load.tolist()]
            module.step_load = None
        return loads
