"""The GPT-OSS family's registry members (``mmtrain.models.registry.ModelFamily``): stage builder, FLOPs, MoE flag,
sharding spec, architecture fields and the Hugging Face bridge, on a run's ``ModelConfig`` (the shape is its
``gpt_oss`` section); plus the named sizes the FLOP count uses."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from mmtrain.config.gpt_oss_schema import GptOssConfig
from mmtrain.config.schema import ModelConfig
from mmtrain.models.gpt_oss import hf_adapter, lora_export
from mmtrain.models.gpt_oss.model import DecoderLayer, GptOssModel
from mmtrain.models.gpt_oss.spec import gpt_oss_sharding_spec
from mmtrain.models.spec import ShardingSpec

STAGE_CLASS, BLOCK_CLASSES = GptOssModel, (DecoderLayer,)
MODEL_TYPES = ("gpt_oss",)


# ------------------------------------------------------------------------------------------ sizes
def count_parameters(cfg: GptOssConfig, active: bool = False) -> int:
    """Parameters of the whole model, biases and sinks included (embedding once when tied); ``active``: only the
    ``num_experts_per_tok`` experts a token uses, which is what the FLOPs follow."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attention = d * (q + 2 * kv) + q * d + cfg.num_attention_heads
    if cfg.attention_bias:
        attention += q + 2 * kv + d
    experts = cfg.num_experts_per_tok if active else cfg.num_local_experts
    moe = cfg.num_local_experts * (d + 1) + experts * (d * 2 * f + 2 * f + f * d + d)
    return (cfg.num_layers * (attention + moe + 2 * d) + d
            + cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2))


def _mean_keys(seq_length: int, window: int | None) -> float:
    """Keys a query attends on average: causal S/2 (the convention of the other families' counts), a window W
    (W(W+1)/2 + (S-W)W) / S, never more than causal."""
    causal = seq_length / 2
    if window is None or window >= seq_length:
        return causal
    return min(causal, (window * (window + 1) / 2 + (seq_length - window) * window) / seq_length)


def flops_per_token(cfg: GptOssConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6 x the active parameters a token multiplies by (the output layer, not the
    embedding lookup) plus attention, 12 * heads * head_dim * (keys attended on average) per layer."""
    matmul = count_parameters(cfg, active=True) - cfg.vocab_size * cfg.hidden_size * (
        1 if cfg.tie_word_embeddings else 2) + cfg.vocab_size * cfg.hidden_size
    attention = sum(12.0 * cfg.num_attention_heads * cfg.head_dim * _mean_keys(seq_length, cfg.window(i))
                    for i in range(cfg.num_layers))
    return 6.0 * matmul + attention


# ------------------------------------------------------------------------------------------ registry members
def build_stage(m: ModelConfig, layer_range: tuple[int, int], pre: bool, post: bool, attention=None,
                moe_dispatch=None, lora=None) -> nn.Module:
    return GptOssModel(m.gpt_oss, layer_range, pre_process=pre, post_process=post, attention=attention,
                       moe_dispatch=moe_dispatch, lora=lora)


def run_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    return flops_per_token(m.gpt_oss, seq_length)


def has_routed_experts(m: ModelConfig) -> bool:
    return True  # every layer is MoE


def sharding_spec(m: ModelConfig) -> ShardingSpec:
    return gpt_oss_sharding_spec(m.gpt_oss)


def architecture(m: ModelConfig) -> dict[str, Any]:
    """The shape fields that change what the weights compute (not the name or the init), ``layer_types`` as
    the list it resolves to."""
    shape = dataclasses.asdict(m.gpt_oss)
    for key in ("name", "init_std"):
        shape.pop(key)
    shape["layer_types"] = [m.gpt_oss.layer_type(i) for i in range(m.gpt_oss.num_layers)]
    return {f"gpt_oss.{k}": v for k, v in shape.items()}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig(family="gpt_oss", gpt_oss=hf_adapter.config_from_hf(hf))


def config_to_hf(m: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    return hf_adapter.config_to_hf(m.gpt_oss, base)


def state_from_hf(tensors, m: ModelConfig):
    return hf_adapter.state_dict_from_hf(tensors, m.gpt_oss)


def state_to_hf(full, m: ModelConfig):
    return hf_adapter.state_dict_to_hf(full, m.gpt_oss)


def errors() -> tuple[type[Exception], ...]:
    return (hf_adapter.HFAdapterError,)


def merge_lora(full, m: ModelConfig, lora):
    return lora_export.merge_lora(full, m.gpt_oss, lora)


def lora_to_peft(full, m: ModelConfig, lora, base_model: str = ""):
    return lora_export.peft_adapter(full, m.gpt_oss, lora, base_model)
