"""How each tensor of ``DeepseekV3Model`` is sharded: the family's rules, and its ``ShardingSpec``.

``SHARDING_SPEC`` is the family's data (patterns over its own tensor names, sizes by config field name);
``deepseek_v3_sharding_spec(cfg, names)`` turns it into the ``mmtrain.models.spec.ShardingSpec`` the shared machinery
reads (``DeepseekV3Model.sharding_spec()``): one entry per tensor of the whole model, sizes in numbers. The
parallel plans are not applied to this family yet. The placements follow the Llama family's conventions:

- ``tp``: ``column`` = output rows split over TP (``dim`` 0), ``row`` = input columns split (``dim`` 1),
  ``vocab`` = embedding rows split (vocab-parallel), ``replicated`` = every TP rank holds it whole.
  ``parts`` names fused blocks along ``dim`` (config size names, or a sum ``a+b`` of them); each part is split
  evenly on its own, as ``_shard_parts`` does for [q | k | v]. ``unit`` is the block a split must not cut (a
  head's rows): TP must divide ``num_attention_heads``.
- ``expert_dim``: the dim sliced over EP (``n_routed_experts / ep`` experts per rank).
- ``grad_reduce``: the data-parallel group the gradient is reduced over: ``dp_cp`` (dense), ``edp`` (experts:
  the ranks holding the same experts).
- ``tp_partial_grad``: when a TP-replicated tensor's gradient is only this rank's part and must be summed over
  ``tp``: ``never``, ``always``, or ``sequence_parallel`` (each TP rank saw only its slice of the sequence).

MLA under TP, the design this spec assumes: the attention input is copied (or, under sequence parallelism,
gathered) over TP once; ``q_down``/``q_norm``/``kv_down``/``kv_norm`` run replicated on it, and the per-head
up-projections (``q_up``/``q_proj``, ``kv_up``) are column-parallel by heads *without* a second input copy. Each
rank back-propagates only its heads into the latents, so those replicated weights' gradients are partial over
TP always (one all-reduce of small gradients instead of two activation all-reduces on the latents). The shared
RoPE key comes out of ``kv_down`` and is therefore replicated. ``attn.proj`` is row-parallel by heads.
MoE: experts are not TP-split (expert TP = 1, as the GPT EP plan); shared experts are a dense SwiGLU MLP,
column/row-parallel like the dense layers. Pipeline stages hold whole layers (``layer_range``); a tied
embedding's copy on the last stage is summed with the first stage's over the ``embd`` group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mmtrain.models.deepseek_v3.config import DeepseekV3Config
from mmtrain.models.spec import ParamSpec, ShardingSpec, lora_adapter_entries


@dataclass(frozen=True)
class TensorSharding:
    """Placement of the tensors whose name fully matches ``pattern`` (see the module docstring)."""

    pattern: str
    tp: str  # column | row | vocab | replicated
    dim: int | None = None
    parts: tuple[str, ...] = ()
    unit: str | None = None
    expert_dim: int | None = None
    grad_reduce: str = "dp_cp"
    tp_partial_grad: str = "never"  # never | always | sequence_parallel
    buffer: bool = False  # not a parameter: no gradient (the routing bias moves by expert load)
    tp_input: str = "auto"  # copy: opens the TP region (latent down-projections); local: inside it (up-projections)


_L = r"layers\.\d+\."
SHARDING_SPEC: tuple[TensorSharding, ...] = (
    TensorSharding(r"embed\.weight", "vocab", dim=0),
    TensorSharding(r"output\.weight", "vocab", dim=0),  # the head strategy copies/gathers its input
    TensorSharding(r"norm\.weight", "replicated", tp_partial_grad="sequence_parallel"),
    TensorSharding(_L + r"(attn_norm|mlp_norm)\.weight", "replicated", tp_partial_grad="sequence_parallel"),
    # MLA: replicated down-projections and latent norms (partial gradients), per-head up-projections
    TensorSharding(_L + r"attn\.q_down\.weight", "replicated", tp_partial_grad="always", tp_input="copy"),
    TensorSharding(_L + r"attn\.q_norm\.weight", "replicated", tp_partial_grad="always"),
    TensorSharding(_L + r"attn\.kv_down\.weight", "replicated", dim=0, parts=("kv_lora_rank", "qk_rope_head_dim"),
                   tp_partial_grad="always", tp_input="copy"),
    TensorSharding(_L + r"attn\.kv_norm\.weight", "replicated", tp_partial_grad="always"),
    TensorSharding(_L + r"attn\.q_up\.weight", "column", dim=0, unit="qk_head_dim", tp_input="local"),
    TensorSharding(_L + r"attn\.q_proj\.weight", "column", dim=0, unit="qk_head_dim"),  # copies its input
    TensorSharding(_L + r"attn\.kv_up\.weight", "column", dim=0, unit="qk_nope_head_dim+v_head_dim",
                   tp_input="local"),
    TensorSharding(_L + r"attn\.proj\.weight", "row", dim=1, unit="v_head_dim"),
    # dense SwiGLU MLP (first layers) and shared experts: [gate | up] column, down row
    TensorSharding(_L + r"mlp\.up\.weight", "column", dim=0, parts=("intermediate_size", "intermediate_size")),
    TensorSharding(_L + r"mlp\.down\.weight", "row", dim=1),
    TensorSharding(_L + r"mlp\.shared\.up\.weight", "column", dim=0,
                   parts=("shared_intermediate_size", "shared_intermediate_size")),
    TensorSharding(_L + r"mlp\.shared\.down\.weight", "row", dim=1),
    # routed MoE: router replicated, experts sliced over EP and reduced over the expert-data-parallel ranks
    TensorSharding(_L + r"mlp\.router\.weight", "replicated", tp_partial_grad="sequence_parallel"),
    TensorSharding(_L + r"mlp\.router\.expert_bias", "replicated", buffer=True),
    TensorSharding(_L + r"mlp\.experts\.w_up", "replicated", dim=2,
                   parts=("moe_intermediate_size", "moe_intermediate_size"), expert_dim=0, grad_reduce="edp",
                   tp_partial_grad="sequence_parallel"),
    TensorSharding(_L + r"mlp\.experts\.w_down", "replicated", expert_dim=0, grad_reduce="edp",
                   tp_partial_grad="sequence_parallel"),
)


def sharding_of(name: str) -> TensorSharding:
    """The one rule for tensor ``name``; ``KeyError`` naming it when none or several match."""
    found = [s for s in SHARDING_SPEC if re.fullmatch(s.pattern, name)]
    if len(found) != 1:
        raise KeyError(f"{name}: {len(found)} sharding rules match (want exactly one)")
    return found[0]


def size_of(expr: str, cfg: DeepseekV3Config) -> int:
    """A ``parts``/``unit`` entry's size: a config size name, or a sum ``a+b`` of them."""
    return sum(int(getattr(cfg, term)) for term in expr.split("+"))


def _param_spec(rule: TensorSharding, cfg: DeepseekV3Config, tied_to: str | None = None) -> ParamSpec:
    unit = size_of(rule.unit, cfg) if rule.unit else 1
    return ParamSpec(rule.tp, dim=rule.dim, parts=tuple(size_of(p, cfg) for p in rule.parts), unit=unit,
                     expert_dim=rule.expert_dim, grad_reduce_group=rule.grad_reduce,
                     tp_partial_grad=rule.tp_partial_grad, tied_to=tied_to, buffer=rule.buffer,
                     tp_input=rule.tp_input)


def deepseek_v3_sharding_spec(cfg: DeepseekV3Config, names: list[str]) -> ShardingSpec:
    """The ``ShardingSpec`` of the whole model of ``cfg`` whose tensors are ``names`` (the model passes the
    names of a meta-device build of itself: exact, no memory); ``output.weight`` also when tied: a pipeline
    last stage's copy of the embedding."""
    names = list(names)
    if "output.weight" not in names:
        names.append("output.weight")
    tied = "embed.weight" if cfg.tie_word_embeddings else None
    out: dict[str, ParamSpec] = {}
    for n in names:
        adapted = re.fullmatch(_ADAPTER, n)
        if adapted:  # a LoRA adapter: placed after its linear's weight
            linear = adapted.group(1)
            out.update(lora_adapter_entries(linear, _param_spec(sharding_of(f"{linear}.weight"), cfg),
                                            dora=f"{linear}.adapter.magnitude" in names))
        else:
            out[n] = _param_spec(sharding_of(n), cfg, tied if n == "output.weight" else None)
    return ShardingSpec(out, "deepseek_v3")


_ADAPTER = r"(.+)\.adapter\.(lora_[AB]\.weight|magnitude)"  # mmtrain.model.lora's names next to the adapted linear
