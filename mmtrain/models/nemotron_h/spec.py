"""How each tensor of ``NemotronHModel`` is sharded (``mmtrain.models.spec``), built from a ``NemotronHConfig``.

Mamba layers split as Megatron-Core's ``MambaMixer``: every TP rank holds ``mamba_num_heads / tp`` heads and
``n_groups / tp`` whole groups. ``in_proj`` is column-parallel part by part ([z | x | B | C | dt]: rank r holds the
r-th slice of each), the depthwise convolution's channels part by part ([x | B | C]), ``dt_bias`` / ``A_log`` /
``D`` by head, the gated norm's weight by channel (whole groups, so the norm is local), ``out_proj`` row-parallel.
Everything between ``in_proj`` and ``out_proj`` runs on the rank's heads over the whole sequence (``in_proj``
gathers it under sequence parallelism), so none of those gradients is partial. Attention layers: fused
[q | k | v] column-parallel by whole heads, ``proj`` row-parallel; MLP layers: ``up`` column, ``down`` row.
Embedding and output layer split by vocabulary (a tied copy on the last stage is tied to ``embed.weight``); the
pre-norms and the final norm are replicated with gradients partial under sequence parallelism. LoRA adapters
follow their linear (``lora_adapter_entries``).
"""

from __future__ import annotations

from mmtrain.models.nemotron_h.config import ATTENTION, LORA_LINEARS, MAMBA, NemotronHConfig
from mmtrain.models.spec import ParamSpec, ShardingSpec, lora_adapter_entries

_SP_PARTIAL = ParamSpec(tp_partial_grad="sequence_parallel")


def _linear(prefix: str, weight: ParamSpec, bias: bool) -> dict[str, ParamSpec]:
    """A linear's weight entry and, with ``bias``, its bias's: split like the output rows for a column linear,
    whole (partial under sequence parallelism, like the output it is added to) for a row linear."""
    out = {f"{prefix}.weight": weight}
    if bias:
        out[f"{prefix}.bias"] = weight if weight.tp == "column" else _SP_PARTIAL
    return out


def mamba_entries(cfg: NemotronHConfig, prefix: str) -> dict[str, ParamSpec]:
    """Entries of one Mamba-2 mixer (``prefix``: ``layers.<i>.mixer``)."""
    inner, gn, heads = cfg.mamba_inner_size, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
    by_head = ParamSpec("column")
    out = _linear(f"{prefix}.in_proj", ParamSpec("column", parts=(inner, inner, gn, gn, heads)), cfg.use_bias)
    out.update(_linear(f"{prefix}.conv1d", ParamSpec("column", parts=(inner, gn, gn)), cfg.use_conv_bias))
    out.update({f"{prefix}.dt_bias": by_head, f"{prefix}.A_log": by_head, f"{prefix}.D": by_head,
                f"{prefix}.norm.weight": by_head})
    out.update(_linear(f"{prefix}.out_proj", ParamSpec("row", unit=cfg.mamba_head_dim), cfg.use_bias))
    return out


def block_entries(cfg: NemotronHConfig, kind: str, prefix: str) -> dict[str, ParamSpec]:
    """Entries of one ``NemotronHBlock`` of ``kind`` (``prefix``: ``layers.<i>``)."""
    out = {f"{prefix}.norm.weight": _SP_PARTIAL}
    if kind == MAMBA:
        out.update(mamba_entries(cfg, f"{prefix}.mixer"))
    elif kind == ATTENTION:
        hd = cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        out.update(_linear(f"{prefix}.mixer.qkv", ParamSpec("column", parts=(q, kv, kv), unit=hd), False))
        out.update(_linear(f"{prefix}.mixer.proj", ParamSpec("row", unit=hd), False))
    else:
        out.update(_linear(f"{prefix}.mixer.up", ParamSpec("column"), cfg.mlp_bias))
        out.update(_linear(f"{prefix}.mixer.down", ParamSpec("row"), cfg.mlp_bias))
    return out


def nemotron_h_sharding_spec(cfg: NemotronHConfig, lora=None) -> ShardingSpec:
    """Every tensor of the whole ``NemotronHModel`` of ``cfg`` (all layers; ``output.weight`` also when tied: the
    last pipeline stage's copy); ``lora`` (a ``LoraConfig`` with rank > 0, targets resolved): its adapters too."""
    out: dict[str, ParamSpec] = {"embed.weight": ParamSpec("vocab")}
    for i, kind in enumerate(cfg.check().layer_kinds()):
        block = block_entries(cfg, kind, f"layers.{i}")
        out.update(block)
        for target in (lora.targets if lora is not None and lora.rank else ()):
            target_kind, linear = LORA_LINEARS[target]
            if target_kind == kind:
                name = f"layers.{i}.{linear}"
                out.update(lora_adapter_entries(name, block[f"{name}.weight"], lora.dora))
    out["norm.weight"] = _SP_PARTIAL
    out["output.weight"] = ParamSpec("vocab", tied_to="embed.weight" if cfg.tie_word_embeddings else None)
    return ShardingSpec(out, "nemotron_h")
