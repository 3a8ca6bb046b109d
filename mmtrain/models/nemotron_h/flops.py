"""Named sizes of a Nemotron-H shape: its parameter count and training FLOPs per token (TFLOP/s and MFU)."""

from __future__ import annotations

from mmtrain.models.nemotron_h.config import ATTENTION, MAMBA, NemotronHConfig


def _layer_parameters(cfg: NemotronHConfig, kind: str) -> tuple[int, int]:
    """(all parameters, those a token multiplies by in a matmul) of one layer of ``kind``, its pre-norm included."""
    d = cfg.hidden_size
    if kind == MAMBA:
        inner, heads = cfg.mamba_inner_size, cfg.mamba_num_heads
        gn = cfg.n_groups * cfg.ssm_state_size
        projected = 2 * inner + 2 * gn + heads
        matmul = d * projected + inner * d
        conv = (inner + 2 * gn) * (cfg.conv_kernel + (1 if cfg.use_conv_bias else 0))
        biases = projected + d if cfg.use_bias else 0
        return d + matmul + conv + 3 * heads + inner + biases, matmul
    if kind == ATTENTION:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        matmul = d * (q + 2 * kv) + q * d
        return d + matmul, matmul
    f = cfg.intermediate_size
    return d + 2 * d * f + (f + d if cfg.mlp_bias else 0), 2 * d * f


def count_parameters(cfg: NemotronHConfig) -> int:
    """Parameters of the whole model (the embedding counted once when tied)."""
    layers = sum(_layer_parameters(cfg, kind)[0] for kind in cfg.check().layer_kinds())
    return layers + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)


def ssd_flops_per_token(cfg: NemotronHConfig) -> float:
    """Forward FLOPs per token of one Mamba layer's chunked scan, counted as the Mamba-2 paper counts its SSD
    algorithm (Dao & Gu 2024, section 6): with chunk length Q, heads H of width P, groups G, state size N, each
    token costs (in multiply-adds) Q*N per group for the diagonal blocks' C.B^T scores, Q*P per head for those
    scores times x, P*N per head for its chunk's state (B^T x) and P*N per head to read the entering state (C h),
    plus the state passed between chunks, P*N per head per chunk:

        ssd_forward = 2 * (Q * (G*N + H*P) + 2*H*P*N + H*P*N / Q)

    (with one group per head and Q = N = P this is the paper's 4*N^2 multiply-adds per head and token: O(T N^2)).
    The depthwise convolution (2 * kernel * channels) is left out like the other elementwise work."""
    Q, H, P = cfg.chunk_size, cfg.mamba_num_heads, cfg.mamba_head_dim
    G, N = cfg.n_groups, cfg.ssm_state_size
    return 2.0 * (Q * (G * N + H * P) + 2 * H * P * N + H * P * N / Q)


def flops_per_token(cfg: NemotronHConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward): 6 x the parameters a token multiplies by (the
    layers' linears and the output layer, not the embedding lookup), plus per attention layer causal attention,
    12 * heads * head_dim * seq_length / 2 (QK^T and PV over the keys a query sees on average), plus per Mamba
    layer 3 x ``ssd_flops_per_token``."""
    kinds = cfg.check().layer_kinds()
    matmul = sum(_layer_parameters(cfg, kind)[1] for kind in kinds) + cfg.vocab_size * cfg.hidden_size
    attention = 12.0 * cfg.num_attention_heads * cfg.head_dim * seq_length / 2 * kinds.count(ATTENTION)
    return 6.0 * matmul + attention + 3.0 * ssd_flops_per_token(cfg) * kinds.count(MAMBA)
