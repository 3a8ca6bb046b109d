"""Named sizes of a DeepSeek-V3 shape: parameter counts (total / active per token) and training FLOPs."""

from __future__ import annotations

from mmtrain.models.deepseek_v3.config import DeepseekV3Config


def _attention_params(c: DeepseekV3Config) -> int:
    h, d = c.num_attention_heads, c.hidden_size
    if c.q_lora_rank is None:
        q = d * h * c.qk_head_dim
    else:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * h * (c.qk_nope_head_dim
                                                                                          + c.v_head_dim)
    return q + kv + h * c.v_head_dim * d


def count_parameters(cfg: DeepseekV3Config, active: bool = False) -> int:
    """Parameters of the whole model (embedding counted once when tied; routing biases are buffers, not
    counted). ``active``: only the ``num_experts_per_tok`` routed experts a token uses — what FLOPs follow."""
    c, d = cfg, cfg.hidden_size
    moe_layers = max(c.num_layers - c.first_k_dense_replace, 0)
    dense_layers = c.num_layers - moe_layers
    routed = c.num_experts_per_tok if active else c.n_routed_experts
    moe = c.n_routed_experts * d + routed * 3 * d * c.moe_intermediate_size + 3 * d * c.shared_intermediate_size
    per_layer = _attention_params(c) + 2 * d
    return (c.num_layers * per_layer + dense_layers * 3 * d * c.intermediate_size + moe_layers * moe
            + c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d)


def flops_per_token(cfg: DeepseekV3Config, seq_length: int) -> float:
    """Training FLOPs per token: 6 x the active parameters a token multiplies by (the output layer, not the
    embedding lookup) plus causal attention: QK^T over qk_head_dim and PV over v_head_dim, half the S x S
    scores, x3 for backward — 3 * L * S * H * (qk_head_dim + v_head_dim)."""
    c = cfg
    matmul = count_parameters(c, active=True) - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    matmul += c.vocab_size * c.hidden_size
    attention = 3.0 * c.num_layers * seq_length * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return 6.0 * matmul + attention
