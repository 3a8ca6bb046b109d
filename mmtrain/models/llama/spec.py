"""The Llama family's sharding spec (``mmtrain.models.spec``), built from a ``ModelConfig``.

Its blocks are the shared ``TransformerBlock``, whose entries (and TP scheme) are ``mmtrain.model.block_spec``'s;
the embedding and output layer are split by vocabulary, the final norm as the blocks' norms. A tied embedding's
copy on the last pipeline stage (``output.weight``) is tied to ``embed.weight``.
"""

from __future__ import annotations

from mmtrain.config.schema import ModelConfig
from mmtrain.model.block_spec import SP_PARTIAL, block_entries, norm_entries
from mmtrain.models.spec import ParamSpec, ShardingSpec, lora_adapter_entries

_LORA_LINEARS = {"qkv": "attn.qkv", "proj": "attn.proj", "up": "mlp.up", "down": "mlp.down"}


def llama_sharding_spec(cfg: ModelConfig, lora=None) -> ShardingSpec:
    """Every tensor of the whole ``GPTModel`` of ``cfg`` (all layers; ``output.weight`` also when tied: the last
    pipeline stage's copy); ``lora`` (a ``LoraConfig`` with rank > 0): also the adapters of its targets."""
    out: dict[str, ParamSpec] = {"embed.weight": ParamSpec("vocab")}
    for i in range(cfg.num_layers):
        block = block_entries(cfg, f"layers.{i}", routed=cfg.moe_layer(i))
        out.update(block)
        if lora is not None and lora.rank:
            for target in lora.targets_for(cfg):
                linear = f"layers.{i}.{_LORA_LINEARS[target]}"
                out.update(lora_adapter_entries(linear, block[f"{linear}.weight"], lora.dora))
    out.update(norm_entries("norm", cfg, SP_PARTIAL))
    out["output.weight"] = ParamSpec("vocab", tied_to="embed.weight" if cfg.tie_embeddings else None)
    return ShardingSpec(out, "llama")
