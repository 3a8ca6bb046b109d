"""How each tensor of ``Gemma3Model`` is sharded (``mmtrain.models.spec``), built from a ``Gemma3Config``.

Megatron-style TP as the Llama family: fused [q | k | v] and [gate | up] column-parallel part by part (whole
heads of ``head_dim`` rows), ``attn.proj`` and ``mlp.down`` row-parallel, embedding and output layer split by
vocabulary. The four block norms and the final norm are replicated; under sequence parallelism each TP rank
normalizes only its slice of the sequence, so their gradients are partial sums. The per-head q/k norm weights are
shared by the heads TP splits, so theirs always are. A tied embedding's copy on the last pipeline stage
(``output.weight``) is tied to ``embed.weight``. LoRA adapters follow their linear (``lora_adapter_entries``).
"""

from __future__ import annotations

from mmtrain.models.gemma3.config import Gemma3Config
from mmtrain.models.spec import ParamSpec, ShardingSpec, lora_adapter_entries

# LoRA target -> the linear it adapts inside a block (HF names in lora_export.py)
LORA_LINEARS = {"qkv": "attn.qkv", "proj": "attn.proj", "up": "mlp.up", "down": "mlp.down"}
BLOCK_NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")

_SP_PARTIAL = ParamSpec(tp_partial_grad="sequence_parallel")


def block_entries(cfg: Gemma3Config, prefix: str) -> dict[str, ParamSpec]:
    """Entries of one ``Gemma3Block`` (``prefix``: ``layers.<i>``)."""
    hd, f = cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {f"{prefix}.{norm}.weight": _SP_PARTIAL for norm in BLOCK_NORMS}
    out[f"{prefix}.attn.qkv.weight"] = ParamSpec("column", parts=(q, kv, kv), unit=hd)
    out[f"{prefix}.attn.q_norm.weight"] = ParamSpec(tp_partial_grad="always")
    out[f"{prefix}.attn.k_norm.weight"] = ParamSpec(tp_partial_grad="always")
    out[f"{prefix}.attn.proj.weight"] = ParamSpec("row", unit=hd)
    out[f"{prefix}.mlp.up.weight"] = ParamSpec("column", parts=(f, f))
    out[f"{prefix}.mlp.down.weight"] = ParamSpec("row")
    return out


def gemma3_sharding_spec(cfg: Gemma3Config, lora=None) -> ShardingSpec:
    """Every tensor of the whole ``Gemma3Model`` of ``cfg`` (all layers; ``output.weight`` also when tied: the last
    pipeline stage's copy); ``lora`` (a ``LoraConfig`` with rank > 0, targets resolved): its adapters too."""
    out: dict[str, ParamSpec] = {"embed.weight": ParamSpec("vocab")}
    for i in range(cfg.num_layers):
        block = block_entries(cfg, f"layers.{i}")
        out.update(block)
        if lora is not None and lora.rank:
            for target in lora.targets:
                linear = f"layers.{i}.{LORA_LINEARS[target]}"
                out.update(lora_adapter_entries(linear, block[f"{linear}.weight"], lora.dora))
    out["norm.weight"] = _SP_PARTIAL
    out["output.weight"] = ParamSpec("vocab", tied_to="embed.weight" if cfg.tie_word_embeddings else None)
    return ShardingSpec(out, "gemma3")
