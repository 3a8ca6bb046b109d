"""The sharding spec entries of the shared transformer block (``mmtrain.model.layers.TransformerBlock``).

The Llama family's spec (``mmtrain.models.llama.spec``) is made of these blocks, and so are the VLM's encoders
(``encoder_sharding_spec``): the entries live with the block, so the encoders need no family.
Megatron-style TP: fused [q | k | v] and [gate | up] column-parallel part by part (whole heads), ``attn.proj``
and ``mlp.down`` row-parallel (their biases whole, gradients partial under sequence parallelism). Norms are
replicated; under sequence parallelism each TP rank normalizes only its slice of the sequence, so their gradients
are partial sums; per-head-dim QK-norm weights are shared by the heads that TP splits, so theirs always are. MoE:
router, experts and shared experts stay whole on every TP rank (expert TP = 1); experts are sliced over EP on
dim 0 and reduced over ``edp``; under sequence parallelism each TP rank routes different tokens, so all their
gradients are partial over TP.
"""

from __future__ import annotations

from mmtrain.config.schema import ModelConfig
from mmtrain.models.spec import REPLICATED, ParamSpec, ShardingSpec

SP_PARTIAL = ParamSpec(tp_partial_grad="sequence_parallel")


def norm_entries(prefix: str, cfg: ModelConfig, spec: ParamSpec) -> dict[str, ParamSpec]:
    names = ("weight",) if cfg.norm == "rmsnorm" else ("weight", "bias")
    return {f"{prefix}.{n}": spec for n in names}


def _linear_entries(prefix: str, kind: str, bias: bool, parts: tuple[int, ...] = (), unit: int = 1,
                    partial: str = "never") -> dict[str, ParamSpec]:
    """A linear's weight (and bias): column = both split; row = weight split, bias whole (partial under SP);
    replicated = both whole, gradients partial as ``partial`` says."""
    if kind == "replicated":
        w = b = ParamSpec(tp_partial_grad=partial)
    elif kind == "column":
        w = b = ParamSpec("column", parts=parts, unit=unit)
    else:
        w, b = ParamSpec("row", unit=unit), SP_PARTIAL
    out = {f"{prefix}.weight": w}
    if bias:
        out[f"{prefix}.bias"] = b
    return out


def block_entries(cfg: ModelConfig, prefix: str, routed: bool | None = None) -> dict[str, ParamSpec]:
    """Entries of one ``mmtrain.model.layers.TransformerBlock`` built from ``cfg`` (``prefix``: ``layers.<i>``);
    the VLM's encoders are made of the same blocks. ``routed``: its MLP is the MoE layer (default: the model has
    experts; the decoder's layers say ``cfg.moe_layer(i)``)."""
    hd = cfg.attention_head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.kv_heads * hd
    out: dict[str, ParamSpec] = {}
    out.update(norm_entries(f"{prefix}.attn_norm", cfg, SP_PARTIAL))
    out.update(norm_entries(f"{prefix}.mlp_norm", cfg, SP_PARTIAL))
    out.update(_linear_entries(f"{prefix}.attn.qkv", "column", cfg.add_bias or cfg.qkv_bias, (q, kv, kv), hd))
    out.update(_linear_entries(f"{prefix}.attn.proj", "row", cfg.add_bias, unit=hd))
    if cfg.qk_norm:
        for which in ("q_norm", "k_norm"):
            out.update(norm_entries(f"{prefix}.attn.{which}", cfg, ParamSpec(tp_partial_grad="always")))
    gated = cfg.activation == "swiglu"
    if not (bool(cfg.num_experts) if routed is None else routed):
        f = cfg.ffn_hidden_size
        out.update(_linear_entries(f"{prefix}.mlp.up", "column", cfg.add_bias, (f, f) if gated else ()))
        out.update(_linear_entries(f"{prefix}.mlp.down", "row", cfg.add_bias))
        return out
    sp = "sequence_parallel"
    out[f"{prefix}.mlp.router.weight"] = ParamSpec(tp_partial_grad=sp)
    out[f"{prefix}.mlp.router.expert_bias"] = ParamSpec(buffer=True)
    expert = ParamSpec(expert_dim=0, grad_reduce_group="edp", tp_partial_grad=sp)
    out[f"{prefix}.mlp.experts.w_up"] = expert
    out[f"{prefix}.mlp.experts.w_down"] = expert
    if cfg.moe_shared_ffn_hidden_size:
        out.update(_linear_entries(f"{prefix}.mlp.shared.up", "replicated", cfg.add_bias, partial=sp))
        out.update(_linear_entries(f"{prefix}.mlp.shared.down", "replicated", cfg.add_bias, partial=sp))
    return out


def encoder_sharding_spec(module, block_cfg: ModelConfig, family: str) -> ShardingSpec:
    """A bidirectional encoder made of ``TransformerBlock``s (``module.layers``): the blocks as in the LM, every
    other tensor of ``module`` (patch/conv stems, position tables, final norm) replicated."""
    out: dict[str, ParamSpec] = {}
    for i in module.layers:
        out.update(block_entries(block_cfg, f"layers.{i}"))
    for name, _ in [*module.named_parameters(), *module.named_buffers()]:
        out.setdefault(name, REPLICATED)
    return ShardingSpec(out, family)
