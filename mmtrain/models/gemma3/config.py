"""The Gemma 3 text family's shape (``model.gemma3``): one documented dataclass and its checks (no torch).

Field names follow transformers' ``Gemma3TextConfig`` where one exists, so ``hf_adapter`` maps them one to one.
Ranges are declared on the fields (``mmtrain.config.ranges``); ``check`` refuses impossible combinations and
``check_layout`` what a parallel layout cannot split, each naming the key.

Layers are local (``sliding_attention``: a query sees itself and the ``sliding_window - 1`` tokens before it,
RoPE base ``rope_local_base_freq``) or global (``full_attention``: causal, RoPE base ``rope_theta``, optionally
linearly scaled), by ``layer_types`` or, when that is empty, by ``sliding_window_pattern`` (every n-th layer global,
as Gemma 3's original configs say it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FamilySection

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # HF's layer_types values
# LoRA targets (mmtrain.models.gemma3.lora_export; HF module names there): the fused q|k|v projection, the
# attention output, the fused gate|up projection and the MLP's down projection
GEMMA3_LORA_TARGETS = ("qkv", "proj", "up", "down")


@dataclass
class Gemma3Config(FamilySection):
    """Shape of a Gemma 3 text decoder: local sliding-window and global layers, q/k RMSNorm, (1 + w) RMSNorms
    around attention and MLP (four per block), GeGLU, the embedding scaled by sqrt(hidden_size)."""

    # capabilities (mmtrain.models.families.FamilySection): no context-parallel sliding-window attention and no
    # FP8 linears yet; the training loop's samples and the VLM take the Llama family only
    supports_fp8 = False
    supports_cp = False
    supports_train_sampling = False
    vlm_language = False

    name: str = doc("gemma3-tiny", "Free-form name of the shape, shown in logs.")
    vocab_size: int = doc(512, "Rows of the embedding table; must exceed every token id in the data.", ge=1)
    hidden_size: int = doc(64, "Width of the residual stream (the embedding is multiplied by its square root).",
                           ge=1)
    intermediate_size: int = doc(128, "Inner width of the GeGLU MLP (per gate).", ge=1)
    num_layers: int = doc(4, "Number of decoder layers (HF: num_hidden_layers).", ge=1)
    num_attention_heads: int = doc(4, "Query heads.", ge=1)
    num_key_value_heads: int = doc(2, "Key/value heads (GQA); must divide num_attention_heads.", ge=1)
    head_dim: int = doc(16, "Width of one attention head (explicit: not hidden_size / heads). Must be even.", ge=2)
    query_pre_attn_scalar: float = doc(16.0, "Attention scores are scaled by query_pre_attn_scalar ** -0.5 "
                                             "(Gemma 3 1B: 256 = head_dim).", gt=0)
    sliding_window: int = doc(8, "Local layers: a query attends itself and the sliding_window - 1 tokens before "
                                 "it.", ge=1)
    layer_types: list[str] = doc([], "Per layer sliding_attention (local) or full_attention (global); empty: "
                                     "from sliding_window_pattern.")
    sliding_window_pattern: int = doc(2, "With layer_types empty: every n-th layer (n-1, 2n-1, ...) is global, "
                                         "the others local (Gemma 3: 6).", ge=1)
    rope_theta: float = doc(1_000_000.0, "RoPE base of the global layers.", gt=1)
    rope_local_base_freq: float = doc(10_000.0, "RoPE base of the local layers.", gt=1)
    rope_scaling: Literal["none", "linear"] = doc("none", "RoPE scaling of the global layers: none, or linear "
                                                          "(positions divided by rope_scaling_factor; Gemma 3 4B+).")
    rope_scaling_factor: float = doc(1.0, "Linear RoPE scaling factor of the global layers.", ge=1)
    attn_logit_softcapping: float | None = doc(None, "Attention scores become c * tanh(score / c); null: off. "
                                                     "transformers' Gemma3 ignores it, so imports refuse it.", gt=0)
    final_logit_softcapping: float | None = doc(None, "Logits become c * tanh(logit / c); null: off.", gt=0)
    rms_norm_eps: float = doc(1e-6, "Epsilon of every RMSNorm.", gt=0, lt=1)
    tie_word_embeddings: bool = doc(True, "Share the input embedding and the output projection (Gemma 3: true).")
    max_position_embeddings: int = doc(32_768, "Longest sequence the model is meant for (HF config field).", ge=1)
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", gt=0)

    # ------------------------------------------------------------------------------------ derived
    def layer_kinds(self) -> tuple[str, ...]:
        """``sliding_attention`` or ``full_attention`` for every layer."""
        if self.layer_types:
            return tuple(self.layer_types)
        return tuple(GLOBAL if (i + 1) % self.sliding_window_pattern == 0 else LOCAL for i in range(self.num_layers))

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer``: ``sliding_window`` for a local layer, None (causal) for a global one."""
        return self.sliding_window if self.layer_kinds()[layer] == LOCAL else None

    def lora_targets(self) -> tuple[str, ...]:
        """The LoRA targets this shape has (every block has all of ``GEMMA3_LORA_TARGETS``)."""
        return GEMMA3_LORA_TARGETS

    # ------------------------------------------------------------------------------------ checks
    def check(self, prefix: str = "") -> Gemma3Config:
        """Raise ``ConfigError`` naming the first impossible field (``prefix`` + name); returns self."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {why}")

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even (RoPE rotates pairs of dims)")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise bad("layer_types", f"has {len(self.layer_types)} entries; it needs one per layer "
                                         f"(num_layers={self.num_layers})")
            odd = next((t for t in self.layer_types if t not in (LOCAL, GLOBAL)), None)
            if odd is not None:
                raise bad("layer_types", f"holds {odd!r}; each entry is {LOCAL!r} or {GLOBAL!r}")
        for key in ("query_pre_attn_scalar", "rope_theta", "rope_local_base_freq", "rms_norm_eps", "init_std"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise bad(key, "must be a positive number")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise bad(key, "must be a positive number, or null for no soft-capping")
        if self.rope_scaling == "linear" and not self.rope_scaling_factor >= 1:
            raise bad("rope_scaling_factor", "must be at least 1")
        if self.rope_scaling == "none" and self.rope_scaling_factor != 1:
            raise bad("rope_scaling_factor", "is set but rope_scaling is none; set rope_scaling: linear or the "
                                             "factor to 1")
        return self

    def check_layout(self, parallel, prefix: str = "") -> None:
        """Raise ``ConfigError`` when the parallel layout cannot split this shape (naming the key); context
        parallelism is refused by the capability check (``supports_cp``)."""
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            if getattr(self, key) % parallel.tp:
                raise ConfigError(f"{prefix}{key} ({getattr(self, key)}) must be divisible by parallel.tp "
                                  f"({parallel.tp})")
        if parallel.ep > 1:
            raise ConfigError(f"parallel.ep={parallel.ep} needs mixture-of-experts layers; gemma3 has none")


SECTION = Gemma3Config
