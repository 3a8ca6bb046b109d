"""How each tensor of ``GptOssModel`` is sharded: its ``ShardingSpec`` (``mmtrain.models.spec``), from the config.

Attention is Megatron-style TP by heads: the fused [q | k | v] projection (weight and bias) column-parallel part by
part in whole heads, ``attn.proj`` row-parallel (its bias whole, its gradient partial under sequence parallelism),
and the per-head sink logits ``attn.sinks`` split like the query heads (rank r holds the sinks of its heads; each
rank's attention is all its heads' gradient, so nothing is partial). Embedding and output layer split by
vocabulary; norms replicated (partial gradients under sequence parallelism). MoE: the router (weight and bias) and
the experts stay whole on every TP rank (expert TP = 1, as in the shared MoE plan); the experts' four tensors are
sliced over EP on dim 0 and reduced over ``edp``; under sequence parallelism each TP rank routes other tokens, so
all their gradients are partial over TP. LoRA adapters (``qkv``, ``proj``) are placed after their linear
(``lora_adapter_entries``). A tied embedding's last-stage copy is tied to ``embed.weight``.
"""

from __future__ import annotations

from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.models.spec import ParamSpec, ShardingSpec, lora_adapter_entries

_SP_PARTIAL = ParamSpec(tp_partial_grad="sequence_parallel")
_EXPERT = ParamSpec(expert_dim=0, grad_reduce_group="edp", tp_partial_grad="sequence_parallel")
LORA_LINEARS = {"qkv": "attn.qkv", "proj": "attn.proj"}  # LoRA target -> its linear in a layer


def layer_entries(cfg: GptOssConfig, prefix: str) -> dict[str, ParamSpec]:
    """The entries of one decoder layer (``prefix``: ``layers.<i>``)."""
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    qkv = ParamSpec("column", parts=(q, kv, kv), unit=hd)
    out = {f"{prefix}.attn_norm.weight": _SP_PARTIAL, f"{prefix}.mlp_norm.weight": _SP_PARTIAL,
           f"{prefix}.attn.qkv.weight": qkv, f"{prefix}.attn.proj.weight": ParamSpec("row", unit=hd),
           f"{prefix}.attn.sinks": ParamSpec("column"),
           f"{prefix}.mlp.router.weight": _SP_PARTIAL, f"{prefix}.mlp.router.bias": _SP_PARTIAL}
    if cfg.attention_bias:
        out[f"{prefix}.attn.qkv.bias"] = qkv
        out[f"{prefix}.attn.proj.bias"] = _SP_PARTIAL
    for name in ("w_up", "b_up", "w_down", "b_down"):
        out[f"{prefix}.mlp.experts.{name}"] = _EXPERT
    return out


def gpt_oss_sharding_spec(cfg: GptOssConfig, lora_targets: tuple[str, ...] = (), dora: bool = False) -> ShardingSpec:
    """Every tensor of the whole model of ``cfg`` (all layers; ``output.weight`` also when tied: the last pipeline
    stage's copy), and the LoRA adapters of ``lora_targets`` (with DoRA magnitudes when ``dora``)."""
    out: dict[str, ParamSpec] = {"embed.weight": ParamSpec("vocab")}
    for i in range(cfg.num_layers):
        layer = layer_entries(cfg, f"layers.{i}")
        out.update(layer)
        for target in lora_targets:
            linear = f"layers.{i}.{LORA_LINEARS[target]}"
            out.update(lora_adapter_entries(linear, layer[f"{linear}.weight"], dora))
    out["norm.weight"] = _SP_PARTIAL
    out["output.weight"] = ParamSpec("vocab", tied_to="embed.weight" if cfg.tie_word_embeddings else None)
    return ShardingSpec(out, "gpt_oss")
