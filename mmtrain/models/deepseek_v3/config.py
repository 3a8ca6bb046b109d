"""The DeepSeek-V3 family's config section: one documented dataclass and its checks (torch-free).

A run selects it with ``model.family: deepseek_v3``; the run schema composes it into ``ModelConfig`` as
``model.deepseek_v3`` from the family table (``mmtrain.models.families``). ``shape_file.load_deepseek_v3_config``
reads it from a YAML file. Field names follow the Hugging Face ``DeepseekV3Config`` where one exists, so the family's
``hf_adapter`` maps them one to one. Ranges are declared on the fields (``mmtrain.config.ranges``); ``check``
rejects impossible combinations, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FamilySection


# LoRA targets of the family (mmtrain.models.deepseek_v3.lora; HF names in docs/post-training.md): MLA's
# q_down/q_up (or q_proj), kv_down (latent | shared rope key), kv_up, proj (output); the dense layers' up
# (gate | up) and down; the MoE layers' shared experts. The routed experts have no adapters.
DEEPSEEK_V3_LORA_TARGETS = ("q_down", "q_up", "q_proj", "kv_down", "kv_up", "proj", "up", "down", "shared_up",
                            "shared_down")


@dataclass
class DeepseekV3Config(FamilySection):
    """Shape of a DeepSeek-V3-style decoder: multi-head latent attention (MLA), sigmoid-routed MoE with shared
    experts and group-limited top-k, the first ``first_k_dense_replace`` layers dense."""

    # capabilities (mmtrain.models.families.FamilySection): MLA has no context-parallel attention (issue #17) and
    # no FP8 linears yet; the training loop's samples and the VLM take the Llama family only
    supports_fp8 = False
    supports_cp = False
    supports_train_sampling = False
    vlm_language = False

    name: str = doc("deepseek-v3-tiny", "Free-form name of the shape, shown in logs.")
    vocab_size: int = doc(512, "Rows of the embedding table; must exceed every token id in the data.", ge=1)
    hidden_size: int = doc(64, "Width of the residual stream.", ge=1)
    num_layers: int = doc(3, "Number of decoder layers (HF: num_hidden_layers).", ge=1)
    num_attention_heads: int = doc(4, "Attention heads; MLA expands keys/values to every head (no GQA).", ge=1)
    q_lora_rank: int | None = doc(32, "Rank of the low-rank query projection (down, RMSNorm, up); null "
                                      "projects queries directly from the hidden state (DeepSeek-V2-Lite).", ge=1)
    kv_lora_rank: int = doc(32, "Width of the compressed key/value latent (normalized, then expanded per head).", ge=1)
    qk_nope_head_dim: int = doc(16, "Per-head query/key dims without positions (expanded from the latent).", ge=0)
    qk_rope_head_dim: int = doc(8, "Per-head query/key dims carrying RoPE; the key part is one shared head "
                                   "(decoupled RoPE). Must be even.", ge=2)
    v_head_dim: int = doc(16, "Per-head value dims (may differ from qk_nope_head_dim + qk_rope_head_dim).", ge=1)
    rope_interleave: bool = doc(True, "RoPE pairs adjacent dims (x0, x1), (x2, x3), ... as DeepSeek's weights "
                                      "are laid out; false rotates halves (Llama style).")
    intermediate_size: int = doc(128, "Inner width of the dense MLP of the first layers (per gate, SwiGLU).", ge=1)
    first_k_dense_replace: int = doc(1, "The first k layers use a dense MLP, the remaining ones MoE.", ge=0)
    n_routed_experts: int = doc(8, "Routed experts per MoE layer.", ge=0)
    n_shared_experts: int = doc(1, "Always-on shared experts; they form one dense MLP of width "
                                   "n_shared_experts * moe_intermediate_size. 0 = none.", ge=0)
    num_experts_per_tok: int = doc(2, "Routed experts each token uses (top-k).", ge=1)
    n_group: int = doc(4, "Expert groups for group-limited routing (n_routed_experts must divide evenly, at "
                          "least two experts per group).", ge=1)
    topk_group: int = doc(2, "Groups a token may route into, chosen by the sum of each group's two best scores.", ge=1)
    routed_scaling_factor: float = doc(2.5, "Multiplier of the routed experts' combined output weights.", gt=0)
    norm_topk_prob: bool = doc(True, "Normalize the chosen experts' sigmoid scores to sum to one before scaling.")
    moe_intermediate_size: int = doc(32, "Inner width of each routed (and shared) expert (per gate, SwiGLU).", ge=1)
    bias_update_rate: float = doc(1e-3, "Auxiliary-loss-free balancing: per-step change of the routing bias "
                                        "(e_score_correction_bias) toward even expert load; 0 freezes it.", ge=0)
    rms_norm_eps: float = doc(1e-6, "Epsilon of the layer norms (the q/kv latent norms always use 1e-6, as "
                                    "DeepSeek's and HF's code do).", gt=0, lt=1)
    tie_word_embeddings: bool = doc(False, "Share the input embedding and the output projection.")
    max_position_embeddings: int = doc(4096, "Longest sequence the model is meant for (HF config field; also "
                                             "yarn's target length when yarn_factor is derived).", ge=1)
    rope_theta: float = doc(10000.0, "Base of the rotary frequencies.", gt=1)
    rope_scaling: Literal["none", "yarn"] = doc("none", "RoPE context extension: none, or YaRN (as DeepSeek-V3).")
    yarn_factor: float = doc(1.0, "YaRN: context extension factor (HF rope_parameters.factor).", ge=1)
    yarn_original_max_position_embeddings: int = doc(4096, "YaRN: the pretraining context length.", ge=1)
    yarn_beta_fast: float = doc(32.0, "YaRN: rotations above which dims keep their frequency (extrapolate).", gt=0)
    yarn_beta_slow: float = doc(1.0, "YaRN: rotations below which dims are interpolated by yarn_factor.", gt=0)
    yarn_mscale: float = doc(0.0, "YaRN: mscale of the cos/sin attention factor; 0 = not set.", ge=0)
    yarn_mscale_all_dim: float = doc(0.0, "YaRN: mscale_all_dim; when set, cos/sin are scaled by "
                                          "m(mscale)/m(mscale_all_dim) and the softmax scale by m(mscale_all_dim)^2.", ge=0)
    yarn_truncate: bool = doc(True, "YaRN: round the correction range to whole dims (HF's truncate).")
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", gt=0)

    # ------------------------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def lora_targets(self) -> tuple[str, ...]:
        """The LoRA targets this shape has (``DEEPSEEK_V3_LORA_TARGETS`` that exist: ``q_proj`` only without a
        query latent, ``q_down``/``q_up`` only with one, ``up``/``down`` only with dense layers, ``shared_*`` only
        with shared experts in MoE layers)."""
        present = {"q_proj": self.q_lora_rank is None, "q_down": self.q_lora_rank is not None,
                   "q_up": self.q_lora_rank is not None, "up": self.first_k_dense_replace > 0,
                   "down": self.first_k_dense_replace > 0,
                   "shared_up": bool(self.n_shared_experts) and self.first_k_dense_replace < self.num_layers,
                   "shared_down": bool(self.n_shared_experts) and self.first_k_dense_replace < self.num_layers}
        return tuple(t for t in DEEPSEEK_V3_LORA_TARGETS if present.get(t, True))

    def yarn_attention_factor(self) -> float:
        """The factor cos/sin are multiplied by (HF ``attention_factor``); 1 without YaRN."""
        if self.rope_scaling != "yarn":
            return 1.0
        if self.yarn_mscale and self.yarn_mscale_all_dim:
            return _yarn_mscale(self.yarn_factor, self.yarn_mscale) / _yarn_mscale(self.yarn_factor,
                                                                                    self.yarn_mscale_all_dim)
        return _yarn_mscale(self.yarn_factor, 1.0)

    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times m(mscale_all_dim)^2 under YaRN (DeepSeek's long-context correction)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling == "yarn" and self.yarn_mscale_all_dim:
            scale *= _yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
        return scale

    # ------------------------------------------------------------------------------------------- checks
    def check(self, prefix: str = "") -> "DeepseekV3Config":
        """Raise ``ConfigError`` naming the first impossible field (``prefix`` + name); returns self."""
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {why}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                    "max_position_embeddings", "n_group", "topk_group"):
            if getattr(self, key) <= 0:
                raise bad(key, "must be positive")
        for key in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "bias_update_rate"):
            if getattr(self, key) < 0:
                raise bad(key, "must not be negative")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise bad("q_lora_rank", "must be positive, or null for a direct query projection")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "must be even (RoPE rotates pairs of dims)")
        if self.first_k_dense_replace < self.num_layers:  # there are MoE layers: the routing must be possible
            if self.n_routed_experts <= 0:
                raise bad("n_routed_experts", "must be positive when some layers are MoE "
                                              "(or set first_k_dense_replace >= num_layers)")
            if self.n_routed_experts % self.n_group:
                raise bad("n_group", f"must divide n_routed_experts ({self.n_routed_experts})")
            if self.n_routed_experts // self.n_group < 2:
                raise bad("n_group", "leaves fewer than two experts per group (groups are ranked by their "
                                     "two best scores)")
            if self.topk_group > self.n_group:
                raise bad("topk_group", f"must not exceed n_group ({self.n_group})")
            if not 0 < self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group):
                raise bad("num_experts_per_tok", "must be between 1 and the experts of the topk_group groups "
                                                 f"({self.topk_group * (self.n_routed_experts // self.n_group)})")
            if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
                raise bad("routed_scaling_factor", "must be a positive number")
        if not 0 < self.rms_norm_eps < 1:
            raise bad("rms_norm_eps", "must be in (0, 1)")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise bad("rope_theta", "must be a number above 1")
        if self.rope_scaling == "yarn":
            if self.yarn_factor < 1:
                raise bad("yarn_factor", "must be at least 1")
            if self.yarn_original_max_position_embeddings <= 0:
                raise bad("yarn_original_max_position_embeddings", "must be positive")
            if self.yarn_beta_fast <= 0 or self.yarn_beta_slow <= 0:
                raise bad("yarn_beta_fast" if self.yarn_beta_fast <= 0 else "yarn_beta_slow", "must be positive")
        if self.init_std <= 0:
            raise bad("init_std", "must be positive")
        return self

    def check_layout(self, parallel, prefix: str = "") -> None:
        """Raise ``ConfigError`` when the layout cannot split this shape: heads, vocabulary and MLP widths by
        ``parallel.tp``, routed experts by ``parallel.ep`` (which needs MoE layers)."""
        p, sk = parallel, prefix.rstrip(".")
        for key in ("num_attention_heads", "vocab_size", "intermediate_size"):
            if getattr(self, key) % p.tp:
                raise ConfigError(f"{prefix}{key} ({getattr(self, key)}) must be divisible by parallel.tp ({p.tp})")
        if self.shared_intermediate_size % p.tp:
            raise ConfigError(f"{prefix}n_shared_experts * {prefix}moe_intermediate_size "
                              f"({self.shared_intermediate_size}) must be divisible by parallel.tp ({p.tp})")
        has_moe = self.first_k_dense_replace < self.num_layers
        if p.ep > 1 and not has_moe:
            raise ConfigError(f"parallel.ep={p.ep} needs MoE layers ({sk}.first_k_dense_replace < "
                              f"{sk}.num_layers)")
        if has_moe and self.n_routed_experts % p.ep:
            raise ConfigError(f"{prefix}n_routed_experts ({self.n_routed_experts}) must be divisible by "
                              f"parallel.ep ({p.ep})")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


SECTION = DeepseekV3Config  # what mmtrain.config.family_sections reads of every family's config module
