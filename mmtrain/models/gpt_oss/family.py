"""The GPT-OSS family's registry record: ``FAMILY``, on its shape (``GptOssConfig``, ``model.gpt_oss``); and the
named sizes its FLOP count uses."""

from __future__ import annotations

import dataclasses

from mmtrain.models.family_record import HFAdapter, ModelFamily, lazy, lazy_values
from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.models.gpt_oss.model import DecoderLayer, GptOssModel

_HF, _LORA = "mmtrain.models.gpt_oss.hf_adapter", "mmtrain.models.gpt_oss.lora_export"


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


def _architecture(cfg: GptOssConfig) -> dict:
    """Every shape field but naming and initialization, ``layer_types`` as the list it resolves to."""
    shape = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("name", "init_std")}
    shape["layer_types"] = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    return shape


FAMILY = ModelFamily(
    stage_class=GptOssModel, block_classes=(DecoderLayer,), flops_per_token=flops_per_token,
    has_routed_experts=lambda cfg: True,  # every layer is MoE
    architecture=_architecture, sharding_spec=lazy("mmtrain.models.gpt_oss.spec:gpt_oss_sharding_spec"),
    hf=HFAdapter(("gpt_oss",), lazy(f"{_HF}:config_from_hf"), lazy(f"{_HF}:config_to_hf"),
                 lazy(f"{_HF}:state_dict_from_hf"), lazy(f"{_HF}:state_dict_to_hf"),
                 lazy_values(f"{_HF}:HFAdapterError"), lazy(f"{_LORA}:merge_lora"), lazy(f"{_LORA}:peft_adapter")))
