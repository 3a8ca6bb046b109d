"""The Llama family's config section: its shape is ``ModelConfig``'s own top-level fields (``model.*``).

``LlamaShape`` holds the fields; ``mmtrain.config.schema.ModelConfig`` derives from it (adding ``family`` and the
other families' sections), so a Llama run writes ``model.hidden_size``, and the VLM encoders build their blocks
from the same fields. Torch-free: the run schema imports it. The family's section interface
(``mmtrain.models.families.FamilySection``): ``check`` (the shape against itself), ``check_layout`` (against
the parallel layout), ``lora_targets``, and the capabilities this family has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FamilySection

LORA_TARGETS = ("qkv", "proj", "up", "down")  # the Llama block's linears (HF: q/k/v_proj, o_proj, gate/up_proj, down_proj)
MOE_LORA_TARGETS = ("qkv", "proj")  # a Llama MoE block: attention only (its experts have no adapters)


@dataclass
class LlamaShape(FamilySection):
    """Shape of a Llama-family decoder (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE): the fields of
    ``model.*``."""

    supports_fp8 = True
    supports_cp = True
    supports_train_sampling = True
    vlm_language = True
    supports_quantization = True

    name: str = doc("tiny", "Free-form name of the shape, shown in logs (e.g. llama3.2-1b).")
    num_layers: int = doc(2, "Number of transformer blocks.", ge=1)
    hidden_size: int = doc(64, "Width of the residual stream.", ge=1)
    ffn_hidden_size: int = doc(176, "Inner width of the MLP (per gate for SwiGLU).", ge=1)
    num_attention_heads: int = doc(4, "Number of query heads.", ge=1)
    num_query_groups: int = doc(0, "Number of key/value heads for GQA/MQA; 0 means one per query head (MHA).", ge=0)
    head_dim: int = doc(0, "Width of each attention head (queries, keys, values, RoPE); 0 means hidden_size / "
                           "num_attention_heads. Qwen3 sets it apart from the width (Qwen3-0.6B: hidden 1024, "
                           "16 heads of 128).", ge=0)
    vocab_size: int = doc(512, "Rows of the embedding table; must exceed every token id in the data.", ge=1)
    norm: Literal["rmsnorm", "layernorm"] = doc("rmsnorm", "Normalization layer kind.")
    norm_eps: float = doc(1e-5, "Epsilon of the normalization layers.", gt=0)
    activation: Literal["swiglu", "gelu", "gelu_erf", "quick_gelu"] = doc(
        "swiglu", "MLP activation: gated SiLU (Llama), GELU with the tanh approximation (gelu; SigLIP's "
                  "gelu_pytorch_tanh), exact GELU (gelu_erf; Whisper) or x*sigmoid(1.702x) (quick_gelu; CLIP).")
    rope_theta: float = doc(10000.0, "Base of the rotary position embedding frequencies.", gt=0)
    rope_scaling_factor: float = doc(1.0, "Llama-3 style RoPE frequency scaling factor; 1.0 disables scaling.", gt=0)
    tie_embeddings: bool = doc(False, "Share the input embedding and the output projection.")
    add_bias: bool = doc(False, "Add biases to all attention and MLP linears.")
    qkv_bias: bool = doc(False, "Add biases to the query/key/value projections only (Qwen2 style).")
    qk_norm: bool = doc(False, "Normalize queries and keys per head before attention (Qwen3/OLMo2 style).")
    sliding_window: int = doc(0, "Sliding-window attention in every layer (Mistral): a query sees itself and the "
                                 "sliding_window - 1 tokens before it (inside its document); 0 = full causal. Not "
                                 "with parallel.cp > 1.", ge=0)
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", ge=0)
    num_experts: int = doc(0, "Mixture of experts: experts per MoE layer; 0 keeps a dense MLP.", ge=0)
    moe_top_k: int = doc(2, "Experts each token is routed to.", ge=1)
    moe_ffn_hidden_size: int = doc(0, "Inner width of each expert; 0 uses ffn_hidden_size.", ge=0)
    moe_router: Literal["softmax", "sigmoid"] = doc(
        "softmax", "softmax top-k (Mixtral) or sigmoid top-k with bias-based balancing (DeepSeek-V3).")
    moe_norm_topk_prob: bool = doc(True, "Divide each token's top-k routing weights by their sum (Mixtral; "
                                         "Qwen3-MoE's norm_topk_prob: true); false weighs the experts by the "
                                         "router's probabilities as they are.")
    moe_dense_layers: list[int] = doc([], "Mixture of experts: layers (0-based) that keep a dense MLP of "
                                          "ffn_hidden_size instead of experts (Qwen3-MoE's mlp_only_layers and "
                                          "decoder_sparse_step).", ge=0)
    moe_aux_loss_coeff: float = doc(0.01, "Weight of the load-balancing auxiliary loss (0 disables).", ge=0)
    moe_z_loss_coeff: float = doc(0.0, "Weight of the router z-loss (0 disables).", ge=0)
    moe_capacity_factor: float = doc(0.0, "Expert capacity as a multiple of the even share; 0 = dropless.", ge=0)
    moe_shared_ffn_hidden_size: int = doc(0, "Width of an always-on shared expert added to the routed ones; "
                                             "0 = none.", ge=0)
    moe_bias_update_rate: float = doc(1e-3, "Sigmoid router: per-step bias step towards balanced expert load.", ge=0)
    moe_grouped_gemm: bool = doc(True, "Run experts as one grouped GEMM (torch._grouped_mm on Hopper, bf16); "
                                       "else a loop over experts.")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """The width of one attention head: ``head_dim``, or hidden_size / num_attention_heads when 0."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` holds routed experts (an MoE model's layers but ``moe_dense_layers``)."""
        return bool(self.num_experts) and index not in self.moe_dense_layers

    def lora_targets(self) -> tuple[str, ...]:
        """The block linears LoRA may adapt: all four, or attention only in a mixture-of-experts model."""
        return MOE_LORA_TARGETS if self.num_experts else LORA_TARGETS

    def check(self, prefix: str = "model.") -> "LlamaShape":
        """Raise ``ConfigError`` naming the first impossible field (``prefix`` + name); returns self."""
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{prefix}hidden_size ({self.hidden_size}) must be divisible by "
                              f"{prefix}num_attention_heads ({self.num_attention_heads}), or set {prefix}head_dim")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"{prefix}num_attention_heads ({self.num_attention_heads}) must be divisible by "
                              f"{prefix}num_query_groups ({self.kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{prefix}head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.attention_head_dim % 2:
            raise ConfigError(f"head dim {prefix}hidden_size / {prefix}num_attention_heads = "
                              f"{self.attention_head_dim} must be even for rotary embeddings")
        self._check_dense_layers(prefix)
        if self.num_experts:
            if self.activation not in ("swiglu", "gelu"):
                raise ConfigError(f"{prefix}activation={self.activation!r}: mixture-of-experts layers support "
                                  "swiglu and gelu")
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise ConfigError(f"{prefix}moe_top_k ({self.moe_top_k}) must be between 1 and "
                                  f"{prefix}num_experts ({self.num_experts})")
        return self

    def _check_dense_layers(self, prefix: str) -> None:
        """``moe_dense_layers``: distinct layers of an MoE model, leaving at least one MoE layer."""
        if not self.moe_dense_layers:
            return
        if not self.num_experts:
            raise ConfigError(f"{prefix}moe_dense_layers is set but {prefix}num_experts=0 (every layer is dense "
                              f"already); remove it or set {prefix}num_experts")
        past = [i for i in self.moe_dense_layers if i >= self.num_layers]
        if past:
            raise ConfigError(f"{prefix}moe_dense_layers: layer {past[0]} is past the last layer ({prefix}num_layers="
                              f"{self.num_layers}; layers count from 0)")
        if len(set(self.moe_dense_layers)) != len(self.moe_dense_layers):
            raise ConfigError(f"{prefix}moe_dense_layers lists a layer twice: {self.moe_dense_layers}")
        if len(self.moe_dense_layers) == self.num_layers:
            raise ConfigError(f"{prefix}moe_dense_layers lists every layer; for a dense model set "
                              f"{prefix}num_experts=0")

    def check_layout(self, parallel, prefix: str = "model.") -> None:
        """Raise ``ConfigError`` when the layout cannot split this shape: heads, key/value heads, MLP width and
        vocabulary by ``parallel.tp``, experts by ``parallel.ep``."""
        p = parallel
        if self.sliding_window and p.cp > 1:
            raise ConfigError(f"parallel.cp={p.cp} is not supported with {prefix}sliding_window={self.sliding_window}: "
                              "the context-parallel attention has no window; use parallel.cp=1 (tp, sp, pp, dp work)")
        if self.num_attention_heads % p.tp:
            raise ConfigError(f"{prefix}num_attention_heads ({self.num_attention_heads}) must be divisible by "
                              f"parallel.tp ({p.tp})")
        if self.kv_heads % p.tp:
            raise ConfigError(f"{prefix}num_query_groups ({self.kv_heads}) must be divisible by parallel.tp "
                              f"({p.tp}); lower tp or use more key/value heads")
        if self.ffn_hidden_size % p.tp:
            raise ConfigError(f"{prefix}ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by parallel.tp "
                              f"({p.tp})")
        if self.vocab_size % p.tp:
            raise ConfigError(f"{prefix}vocab_size ({self.vocab_size}) must be divisible by parallel.tp ({p.tp}); "
                              "pad the vocabulary")
        if self.num_experts and self.num_experts % p.ep:
            raise ConfigError(f"{prefix}num_experts ({self.num_experts}) must be divisible by parallel.ep ({p.ep})")
        if not self.num_experts and p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} needs a mixture-of-experts model ({prefix}num_experts > 0)")


SECTION = LlamaShape  # what mmtrain.config.family_sections reads of every family's config module
