"""The GPT-OSS family's config section: one documented dataclass and its checks (torch-free).

A run selects it with ``model.family: gpt_oss``; the run schema composes it into ``ModelConfig`` as
``model.gpt_oss`` from the family table (``mmtrain.models.families``). Field names follow the Hugging Face
``GptOssConfig`` where one exists (``num_layers`` is HF's ``num_hidden_layers``; the RoPE fields are HF's
``rope_parameters``), so the family's ``hf_adapter`` maps them one to one. Ranges are declared on the fields
(``mmtrain.config.ranges``); ``check`` rejects impossible combinations and ``check_layout`` impossible parallel
layouts, naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FamilySection

LAYER_TYPES = ("sliding_attention", "full_attention")
# LoRA targets (mmtrain.models.gpt_oss.lora_export): the fused q|k|v projection and the attention output. The
# experts are fused 3-D parameters in transformers, not linears peft can adapt, and have none here either.
GPT_OSS_LORA_TARGETS = ("qkv", "proj")


@dataclass
class GptOssConfig(FamilySection):
    """Shape of a GPT-OSS decoder: grouped-query attention with biases, a learned sink logit per head,
    sliding-window and full layers (``layer_types``), YaRN RoPE, and in every layer a mixture of experts (softmax
    over the top-k router logits, router and experts with biases, clamped SwiGLU)."""

    # capabilities (mmtrain.models.families.FamilySection): the context-parallel kernels take no sinks or
    # windows, there are no FP8 expert linears, and the training loop's samples and the VLM take Llama only
    supports_fp8 = False
    supports_cp = False
    supports_train_sampling = False
    vlm_language = False

    name: str = doc("gpt-oss-tiny", "Free-form name of the shape, shown in logs.")
    vocab_size: int = doc(128, "Rows of the embedding table; must exceed every token id in the data.", ge=1)
    hidden_size: int = doc(64, "Width of the residual stream.", ge=1)
    num_layers: int = doc(4, "Number of decoder layers (HF: num_hidden_layers).", ge=1)
    num_attention_heads: int = doc(4, "Query heads (each with its own sink logit).", ge=1)
    num_key_value_heads: int = doc(2, "Key/value heads (grouped-query attention); must divide the query heads.",
                                   ge=1)
    head_dim: int = doc(16, "Width of one attention head (GPT-OSS sets it apart from hidden_size: 64 heads x 64 "
                            "= 4096 != 2880). Must be even (RoPE).", ge=2)
    attention_bias: bool = doc(True, "Biases on the q/k/v and output projections.")
    sliding_window: int = doc(8, "Keys a sliding-window layer's query sees: itself and the sliding_window - 1 "
                                 "before it (HF's semantics). 0 = no window (then no layer may be sliding).", ge=0)
    layer_types: list[str] = doc([], "Per layer sliding_attention or full_attention; empty = HF's default: "
                                     "sliding on even layers (0, 2, ...), full on odd ones.")
    intermediate_size: int = doc(32, "Inner width of each expert (per gate of the SwiGLU).", ge=1)
    num_local_experts: int = doc(4, "Experts per MoE layer (every layer is MoE).", ge=1)
    num_experts_per_tok: int = doc(2, "Experts each token uses: softmax over its top-k router logits.", ge=1)
    swiglu_alpha: float = doc(1.702, "Sigmoid gain of the experts' clamped SwiGLU: (up + 1) * g * sigmoid(alpha g).",
                              gt=0)
    swiglu_limit: float = doc(7.0, "Clamp of the experts' SwiGLU: gate <= limit, -limit <= up <= limit.", gt=0)
    rms_norm_eps: float = doc(1e-5, "Epsilon of the RMS norms.", gt=0, lt=1)
    tie_word_embeddings: bool = doc(False, "Share the input embedding and the output projection (GPT-OSS: no).")
    max_position_embeddings: int = doc(131072, "Longest sequence the model is meant for (HF config field).", ge=1)
    rope_theta: float = doc(150000.0, "Base of the rotary frequencies.", gt=1)
    rope_scaling: Literal["none", "yarn"] = doc("yarn", "RoPE context extension: none, or YaRN (GPT-OSS).")
    yarn_factor: float = doc(32.0, "YaRN: context extension factor (HF rope_parameters.factor).", ge=1)
    yarn_original_max_position_embeddings: int = doc(4096, "YaRN: the pretraining context length.", ge=1)
    yarn_beta_fast: float = doc(32.0, "YaRN: rotations above which dims keep their frequency (extrapolate).", gt=0)
    yarn_beta_slow: float = doc(1.0, "YaRN: rotations below which dims are interpolated by yarn_factor.", gt=0)
    yarn_truncate: bool = doc(False, "YaRN: round the correction range to whole dims (HF's truncate; GPT-OSS: "
                                     "false).")
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", gt=0)

    # ------------------------------------------------------------------------------------ derived
    def layer_type(self, layer: int) -> str:
        """``sliding_attention`` or ``full_attention`` for global layer index ``layer``."""
        if self.layer_types:
            return self.layer_types[layer]
        return "sliding_attention" if layer % 2 == 0 else "full_attention"

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: full causal attention)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def yarn_attention_factor(self) -> float:
        """The factor HF multiplies cos/sin by: 0.1 ln(factor) + 1 under YaRN (factor > 1), else 1."""
        if self.rope_scaling != "yarn" or self.yarn_factor <= 1:
            return 1.0
        return 0.1 * math.log(self.yarn_factor) + 1.0

    def lora_targets(self) -> tuple[str, ...]:
        """Every LoRA target of this family (``GPT_OSS_LORA_TARGETS``)."""
        return GPT_OSS_LORA_TARGETS

    # ------------------------------------------------------------------------------------ checks
    def check(self, prefix: str = "") -> GptOssConfig:
        """Raise ``ConfigError`` naming the first impossible field (``prefix`` + name); returns self."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {why}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even (RoPE rotates pairs of dims)")
        if self.num_experts_per_tok > self.num_local_experts:
            raise bad("num_experts_per_tok", f"must not exceed num_local_experts ({self.num_local_experts})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise bad("layer_types", f"has {len(self.layer_types)} entries; it needs one per layer "
                                         f"(num_layers={self.num_layers}) or none")
            unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
            if unknown:
                raise bad("layer_types", f"{unknown[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if self.sliding_window < 0 or (self.sliding_window == 0 and any(
                self.layer_type(i) == "sliding_attention" for i in range(self.num_layers))):
            raise bad("sliding_window", "must be positive when a layer is sliding_attention (layer_types)")
        for key in ("swiglu_alpha", "swiglu_limit", "init_std"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                raise bad(key, "must be a positive number")
        if not 0 < self.rms_norm_eps < 1:
            raise bad("rms_norm_eps", "must be in (0, 1)")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise bad("rope_theta", "must be a number above 1")
        if self.rope_scaling == "yarn":
            if not self.yarn_factor >= 1:
                raise bad("yarn_factor", "must be at least 1")
            if self.yarn_original_max_position_embeddings <= 0:
                raise bad("yarn_original_max_position_embeddings", "must be positive")
            for key in ("yarn_beta_fast", "yarn_beta_slow"):
                if not getattr(self, key) > 0:
                    raise bad(key, "must be positive")
        return self

    def check_layout(self, parallel, prefix: str = "") -> None:
        """The parallel layout (``ParallelConfig``) this shape allows: query heads, key/value heads and the
        vocabulary split over ``parallel.tp``, experts over ``parallel.ep`` (``prefix``: where the fields sit,
        e.g. ``model.gpt_oss.``)."""
        for key in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
            if getattr(self, key) % parallel.tp:
                raise ConfigError(f"{prefix}{key} ({getattr(self, key)}) must be divisible by parallel.tp "
                                  f"({parallel.tp})")
        if self.num_local_experts % parallel.ep:
            raise ConfigError(f"{prefix}num_local_experts ({self.num_local_experts}) must be divisible by "
                              f"parallel.ep ({parallel.ep})")


SECTION = GptOssConfig  # what mmtrain.config.family_sections reads of every family's config module
