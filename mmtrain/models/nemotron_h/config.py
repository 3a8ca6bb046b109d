"""The Nemotron-H hybrid family's shape (``model.nemotron_h``): one documented dataclass and its checks (no torch).

Field names follow transformers' ``NemotronHConfig`` where one exists, so the HF adapter maps them one to one.
The layers are spelled by ``hybrid_override_pattern``, one character per layer, as Megatron-LM and the Nemotron-H
checkpoints write it: ``M`` a Mamba-2 mixer, ``*`` self-attention (no positional embedding: the Mamba layers
carry position), ``-`` an MLP (relu^2, no gate). ``E`` (a mixture-of-experts layer) is refused for now. Every
layer is one pre-norm residual block: ``x + mixer(norm(x))``; ``num_layers`` is the pattern's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FamilySection

MAMBA, ATTENTION, MLP = "mamba", "attention", "mlp"
PATTERN_LETTERS = {"M": MAMBA, "*": ATTENTION, "-": MLP}
REFUSED_LETTERS = {"E": "mixture-of-experts layers are not supported by the nemotron_h family yet"}
# LoRA target -> the linear it adapts, and the layer kind that has it
LORA_LINEARS = {"in_proj": (MAMBA, "mixer.in_proj"), "out_proj": (MAMBA, "mixer.out_proj"),
                "qkv": (ATTENTION, "mixer.qkv"), "proj": (ATTENTION, "mixer.proj"),
                "up": (MLP, "mixer.up"), "down": (MLP, "mixer.down")}


@dataclass
class NemotronHConfig(FamilySection):
    """Shape of a Nemotron-H hybrid decoder: Mamba-2, attention and MLP layers by ``hybrid_override_pattern``."""

    # capabilities (mmtrain.models.families.FamilySection): no context parallelism (the scan would pass its
    # state between CP ranks), no FP8 linears, the training loop's samples and the VLM take the Llama family only
    supports_fp8 = False
    supports_cp = False
    supports_train_sampling = False
    vlm_language = False

    name: str = doc("nemotron-h-tiny", "Free-form name of the shape, shown in logs.")
    vocab_size: int = doc(256, "Rows of the embedding table; must exceed every token id in the data.", ge=1)
    hidden_size: int = doc(64, "Width of the residual stream.", ge=1)
    hybrid_override_pattern: str = doc("M*M-", "One character per layer: M Mamba-2 mixer, * attention, - MLP "
                                               "(E, mixture of experts, is refused). Its length is the number of "
                                               "layers (HF: num_hidden_layers).")
    # attention layers
    num_attention_heads: int = doc(4, "Query heads of the attention layers.", ge=1)
    num_key_value_heads: int = doc(2, "Key/value heads of the attention layers (GQA); must divide "
                                      "num_attention_heads.", ge=1)
    head_dim: int = doc(16, "Width of one attention head (explicit: not hidden_size / heads).", ge=1)
    # MLP layers
    intermediate_size: int = doc(128, "Inner width of the MLP layers.", ge=1)
    mlp_hidden_act: Literal["relu2"] = doc("relu2", "MLP activation: relu(x)^2 (Nemotron-H's), no gate.")
    mlp_bias: bool = doc(False, "Biases on the MLP layers' linears.")
    # Mamba-2 layers
    mamba_num_heads: int = doc(8, "Heads of the Mamba-2 mixers (the scan's H); inner width = heads x head dim.",
                               ge=1)
    mamba_head_dim: int = doc(8, "Width of one Mamba-2 head (the scan's P).", ge=1)
    ssm_state_size: int = doc(16, "State size per head and group (the scan's N).", ge=1)
    n_groups: int = doc(2, "Groups of B and C (heads share their group's); the gated norm normalizes per group. "
                           "Must divide mamba_num_heads.", ge=1)
    conv_kernel: int = doc(4, "Width of the depthwise causal convolution over x|B|C.", ge=1)
    chunk_size: int = doc(8, "Tokens per chunk of the chunked scan (Nemotron-H: 128); the result does not "
                             "depend on it beyond rounding.", ge=1)
    use_conv_bias: bool = doc(True, "Bias on the convolution.")
    use_bias: bool = doc(False, "Biases on the Mamba mixers' in/out projections.")
    mamba_hidden_act: Literal["silu"] = doc("silu", "Activation after the convolution.")
    time_step_min: float = doc(0.001, "Initialization: dt is drawn log-uniformly in [time_step_min, "
                                      "time_step_max] (dt_bias = its inverse softplus).", gt=0)
    time_step_max: float = doc(0.1, "Initialization: the upper end of dt's range.", gt=0)
    time_step_floor: float = doc(1e-4, "Initialization: dt is at least this.", ge=0)
    time_step_limit: list[float | None] = doc([0.0, None], "dt = softplus(dt + dt_bias) is clamped to [low, high] "
                                                           "in every Mamba mixer; null high: no upper bound.", ge=0)
    # the rest
    layer_norm_epsilon: float = doc(1e-5, "Epsilon of every RMSNorm (the blocks', the final one, the gated norm).",
                                    gt=0, lt=1)
    residual_in_fp32: bool = doc(False, "Keep the residual stream in fp32 (not supported: must be false; "
                                        "transformers' NemotronH does not read it either).")
    tie_word_embeddings: bool = doc(False, "Share the input embedding and the output projection.")
    max_position_embeddings: int = doc(8192, "Longest sequence the model is meant for (HF config field; no "
                                             "positional embedding depends on it).", ge=1)
    initializer_range: float = doc(0.02, "Standard deviation of the normal weight initialization.", gt=0)
    rescale_prenorm_residual: bool = doc(True, "Initialization: the projections that write into the residual "
                                               "stream are scaled by 1 / sqrt(num_layers).")

    # ------------------------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        """Number of layers: one per character of the pattern."""
        return len(self.hybrid_override_pattern)

    def layer_kinds(self) -> tuple[str, ...]:
        """``mamba``, ``attention`` or ``mlp`` for every layer (call ``check`` first: unknown letters raise here)."""
        return tuple(PATTERN_LETTERS[c] for c in self.hybrid_override_pattern)

    def kinds_present(self) -> set[str]:
        return {PATTERN_LETTERS[c] for c in self.hybrid_override_pattern if c in PATTERN_LETTERS}

    @property
    def mamba_inner_size(self) -> int:
        """Width of a Mamba mixer's x (and z): heads x head dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    def dt_limit(self) -> tuple[float, float]:
        """``time_step_limit`` as numbers (an open upper end is infinity)."""
        low, high = self.time_step_limit
        return float(low), math.inf if high is None else float(high)

    def lora_targets(self) -> tuple[str, ...]:
        """The linears LoRA may adapt: those of the layer kinds the pattern has."""
        kinds = self.kinds_present()
        return tuple(t for t, (kind, _) in LORA_LINEARS.items() if kind in kinds)

    # ------------------------------------------------------------------------------------ checks
    def check(self, prefix: str = "") -> NemotronHConfig:
        """Raise ``ConfigError`` naming the first impossible field (``prefix`` + name); returns self."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {why}")

        pattern = self.hybrid_override_pattern
        if not pattern:
            raise bad("hybrid_override_pattern", "is empty; write one character per layer (M Mamba-2, * attention, "
                                                 "- MLP)")
        for i, c in enumerate(pattern):
            if c in REFUSED_LETTERS:
                raise bad("hybrid_override_pattern", f"layer {i} is {c!r}: {REFUSED_LETTERS[c]}; use M, * or -")
            if c not in PATTERN_LETTERS:
                raise bad("hybrid_override_pattern", f"layer {i} is {c!r}, not a layer letter; use M (Mamba-2), "
                                                     "* (attention) or - (MLP)")
        for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                    "conv_kernel", "chunk_size", "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.mamba_num_heads % self.n_groups:
            raise bad("n_groups", f"must divide mamba_num_heads ({self.mamba_num_heads})")
        for key in ("time_step_min", "time_step_max", "layer_norm_epsilon", "initializer_range"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise bad(key, "must be a positive number")
        if self.time_step_min > self.time_step_max:
            raise bad("time_step_min", f"is above time_step_max ({self.time_step_max})")
        if not (math.isfinite(self.time_step_floor) and self.time_step_floor >= 0):
            raise bad("time_step_floor", "must be a number >= 0")
        limit = self.time_step_limit
        if len(limit) != 2 or limit[0] is None or not (math.isfinite(limit[0]) and limit[0] >= 0):
            raise bad("time_step_limit", "must be [low, high] with 0 <= low (high: a number, or null for none)")
        if limit[1] is not None and not (math.isfinite(limit[1]) and limit[1] > limit[0]):
            raise bad("time_step_limit", "high must be above low (or null for no upper bound)")
        if self.residual_in_fp32:
            raise bad("residual_in_fp32", "is not supported; set it to false (the residual stream keeps the run's "
                                          "dtype, as transformers' NemotronH computes it)")
        return self

    def check_layout(self, parallel, prefix: str = "") -> None:
        """Raise ``ConfigError`` when the parallel layout cannot split this shape (naming the key): TP splits the
        attention heads, the MLP width, the Mamba heads and groups (whole groups per rank, as Megatron's
        MambaMixer) and the vocabulary. Context parallelism is refused by the capability check (``supports_cp``)."""
        kinds = self.kinds_present()
        keys = ["vocab_size"]
        keys += ["num_attention_heads", "num_key_value_heads"] if ATTENTION in kinds else []
        keys += ["intermediate_size"] if MLP in kinds else []
        keys += ["mamba_num_heads", "n_groups"] if MAMBA in kinds else []
        for key in keys:
            if getattr(self, key) % parallel.tp:
                raise ConfigError(f"{prefix}{key} ({getattr(self, key)}) must be divisible by parallel.tp "
                                  f"({parallel.tp})")
        if parallel.ep > 1:
            raise ConfigError(f"parallel.ep={parallel.ep} needs mixture-of-experts layers; the nemotron_h family has "
                              "none")


SECTION = NemotronHConfig
