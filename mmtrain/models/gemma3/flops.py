"""Named sizes of a Gemma 3 shape: its parameter count and training FLOPs per token (TFLOP/s and MFU)."""

from __future__ import annotations

from mmtrain.models.gemma3.config import Gemma3Config


def count_parameters(cfg: Gemma3Config) -> int:
    """Parameters of the whole model (the embedding counted once when tied)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    block = d * (q + 2 * kv) + q * d + 2 * hd + 3 * d * cfg.intermediate_size + 4 * d
    return cfg.num_layers * block + cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2) + d


def mean_keys(seq_length: int, window: int | None) -> float:
    """Keys a query attends on average in a causal sequence of ``seq_length`` (``window``: at most that many):
    S/2 causal; W - W^2/(2S) once the window is shorter than the sequence (equal at S = W)."""
    if window is None or window >= seq_length:
        return seq_length / 2
    return window - window * window / (2 * seq_length)


def flops_per_token(cfg: Gemma3Config, seq_length: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token multiplies by (the output layer, not the embedding
    lookup) plus attention: QK^T and PV over the keys each layer attends (local layers their window), x3 for
    backward -- 12 * H * head_dim * mean keys per layer."""
    matmul = count_parameters(cfg) - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    matmul += cfg.vocab_size * cfg.hidden_size
    per_key = 12.0 * cfg.num_attention_heads * cfg.head_dim
    attention = sum(per_key * mean_keys(seq_length, cfg.window(i)) for i in range(cfg.num_layers))
    return 6.0 * matmul + attention
