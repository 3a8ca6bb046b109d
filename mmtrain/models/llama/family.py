"""The Llama family's registry record (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE shapes): ``FAMILY``,
on its shape (``ModelConfig``, whose own fields are the Llama shape)."""

from __future__ import annotations

from mmtrain.model.layers import TransformerBlock
from mmtrain.models.family_record import HFAdapter, ModelFamily, lazy, lazy_values
from mmtrain.models.llama.model import GPTModel, flops_per_token

# shape fields that change what the weights compute (not name, init_std, routing-bias or loss settings)
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "head_dim", "vocab_size", "norm", "norm_eps", "activation", "rope_theta",
                       "rope_scaling_factor", "tie_embeddings", "add_bias", "qkv_bias", "qk_norm", "num_experts",
                       "moe_top_k", "moe_ffn_hidden_size", "moe_router", "moe_norm_topk_prob", "moe_dense_layers",
                       "moe_shared_ffn_hidden_size", "sliding_window")


def architecture(cfg) -> dict:
    """``ARCHITECTURE_FIELDS`` of ``cfg``; ``head_dim`` as the model uses it (0 and the width it stands for build
    the same weights), ``moe_dense_layers`` in order."""
    resolved = {"head_dim": cfg.attention_head_dim, "moe_dense_layers": sorted(cfg.moe_dense_layers)}
    return {k: resolved.get(k, getattr(cfg, k)) for k in ARCHITECTURE_FIELDS}


_HF, _LORA = "mmtrain.models.llama.hf_adapter", "mmtrain.models.llama.lora_export"

FAMILY = ModelFamily(
    stage_class=GPTModel, block_classes=(TransformerBlock,), flops_per_token=flops_per_token,
    has_routed_experts=lambda cfg: any(cfg.moe_layer(i) for i in range(cfg.num_layers)),
    architecture=architecture,
    sharding_spec=lazy("mmtrain.models.llama.spec:llama_sharding_spec"),
    hf=HFAdapter(("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe"), lazy(f"{_HF}:model_config_from_hf"),
                 lazy(f"{_HF}:hf_config_from_model_config"), lazy(f"{_HF}:mmtrain_state_from_hf"),
                 lazy(f"{_HF}:hf_state_from_mmtrain"), lazy_values(f"{_HF}:UnsupportedHFConfig"),
                 lazy(f"{_LORA}:merge_lora"), lazy(f"{_LORA}:peft_adapter")))
