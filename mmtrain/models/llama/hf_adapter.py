"""Hugging Face Llama / Mistral / Qwen2 / Mixtral <-> mmtrain: the config mapping and the parameter name mapping.

Everything here works on *full* (unsharded) tensors keyed by name; splitting over TP/PP lives in
``checkpoint_io``. Our fused projections are concatenations of HF's separate ones, row-wise:
``attn.qkv`` = [q_proj | k_proj | v_proj] (heads in order, as HF stores them) and ``mlp.up`` =
[gate_proj | up_proj]. Both sides use the rotate-half RoPE convention, so no row permutation is needed.
Mixtral experts are stacked and transposed: ``experts.w_up[e]`` = [w1 | w3]^T (D, 2F), ``w_down[e]`` = w2^T.
Mistral is the Llama layout with a sliding window (``model.sliding_window``); Mixtral's and Qwen2's windows map to
the same field when every layer has it (Qwen2's ``use_sliding_window`` with all layers past ``max_window_layers``).
Before any tensor is mapped, the config's layer and expert counts and every shape it implies are checked against
the tensors' shapes (``mmtrain.models.hf_shapes``): a contradiction is one ``UnsupportedHFConfig`` naming the key.
"""

from __future__ import annotations

from typing import Any

import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, indices

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
# The Llama-3 scaling constants our ``rope_frequencies`` implements (mmtrain/model/layers.py).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedHFConfig(ValueError):
    """The HF config uses an option mmtrain's model does not implement; the message names the key."""


# ------------------------------------------------------------------------------------------------ config
def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, float]:
    """(rope_theta, rope_scaling_factor) from either the transformers-4 keys (``rope_theta``,
    ``rope_scaling``) or the transformers-5 ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, 1.0
    if rope_type != "llama3":
        raise UnsupportedHFConfig(f"rope_scaling.rope_type={rope_type!r} is not supported; mmtrain implements "
                                  "'default' (no scaling) and 'llama3' only")
    for key, expected in LLAMA3_ROPE.items():
        if key in params and float(params[key]) != expected:
            raise UnsupportedHFConfig(f"rope_scaling.{key}={params[key]} is not supported; mmtrain's llama3 "
                                      f"scaling uses {key}={expected:g}")
    return theta, float(params["factor"])


def _require(hf: dict[str, Any], key: str, allowed: tuple, default: Any = None) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise UnsupportedHFConfig(f"{key}={value!r} is not supported; supported: {', '.join(map(repr, allowed))}")


def _window_from_hf(hf: dict[str, Any], model_type: str) -> int:
    """``model.sliding_window`` (0 = none) from Mistral's / Mixtral's ``sliding_window`` or Qwen2's
    ``use_sliding_window`` + ``sliding_window`` on the layers ``layer_types`` (else ``max_window_layers``) marks."""
    if model_type == "llama":
        return 0  # LlamaForCausalLM has no window, whatever the file holds
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        return 0  # transformers drops Qwen2's window unless use_sliding_window
    if hf.get("sliding_window") is None:
        return 0
    window = config_int(hf, "sliding_window", UnsupportedHFConfig)
    if model_type != "qwen2":
        return window
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        start = config_int(hf, "max_window_layers", UnsupportedHFConfig, minimum=0, default=28)
        kinds = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"sliding_attention",
                                                                                "full_attention"}:
        raise UnsupportedHFConfig(f"layer_types={kinds!r} must list 'sliding_attention' or 'full_attention' for each "
                                  f"of the {layers} layers")
    if len(set(kinds)) > 1:
        raise UnsupportedHFConfig("use_sliding_window with both sliding and full layers (layer_types / "
                                  "max_window_layers) is not supported: mmtrain's model.sliding_window applies to "
                                  "every layer")
    return window if kinds[0] == "sliding_attention" else 0


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ``ModelConfig`` for an HF ``config.json`` mapping; raises ``UnsupportedHFConfig`` naming the key."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedHFConfig(f"model_type={model_type!r} is not supported; supported: "
                                  f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)  # Llama's bias on q/k/v *and* o: no mmtrain equivalent
    _require(hf, "mlp_bias", (False,), False)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        config_int(hf, key, UnsupportedHFConfig)
    for key in ("num_key_value_heads", "head_dim"):  # absent or null: derived from the head count
        if hf.get(key) is not None:
            config_int(hf, key, UnsupportedHFConfig)
    if model_type == "mixtral":
        config_int(hf, "num_local_experts", UnsupportedHFConfig)
        config_int(hf, "num_experts_per_tok", UnsupportedHFConfig)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise UnsupportedHFConfig(f"head_dim={head_dim} with num_attention_heads={heads} must equal hidden_size "
                                  f"({hf['hidden_size']}): mmtrain derives head_dim as hidden_size / heads")
    theta, factor = _rope_from_hf(hf)
    kv_heads = hf.get("num_key_value_heads") or heads
    cfg = ModelConfig(
        name=hf.get("_name_or_path") or model_type,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=0 if kv_heads == heads else kv_heads,
        vocab_size=hf["vocab_size"],
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        rope_theta=theta,
        rope_scaling_factor=factor,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        sliding_window=_window_from_hf(hf, model_type),
    )
    if model_type == "mixtral":
        cfg.num_experts = hf["num_local_experts"]
        cfg.moe_top_k = hf["num_experts_per_tok"]
        cfg.moe_router = "softmax"
        cfg.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.01))
    return cfg


def _hf_model_type_of(cfg: ModelConfig, base: dict[str, Any] | None) -> str:
    """Mixtral (experts), Qwen2 (q/k/v biases), Mistral (a window, or converted from a Mistral), else Llama."""
    if cfg.num_experts:
        return "mixtral"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window or (base or {}).get("model_type") == "mistral" else "llama"


def hf_config_from_model_config(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping for ``cfg``. ``base`` (the config the checkpoint was converted from, if
    any) supplies the fields mmtrain does not model, e.g. token ids and max_position_embeddings."""
    unsupported = {"norm": ("rmsnorm",), "activation": ("swiglu",), "add_bias": (False,), "qk_norm": (False,)}
    if cfg.num_experts:
        unsupported.update({"moe_shared_ffn_hidden_size": (0,), "moe_router": ("softmax",)})
    for key, allowed in unsupported.items():
        if getattr(cfg, key) not in allowed:
            raise UnsupportedHFConfig(f"model.{key}={getattr(cfg, key)!r} has no Llama/Qwen2/Mixtral equivalent; "
                                      f"supported: {', '.join(map(repr, allowed))}")
    if cfg.num_experts and cfg.moe_ffn_hidden_size not in (0, cfg.ffn_hidden_size):
        raise UnsupportedHFConfig("model.moe_ffn_hidden_size must be 0 or equal ffn_hidden_size for Mixtral")
    model_type = _hf_model_type_of(cfg, base)
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == model_type:
        hf.update({k: v for k, v in base.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")})
    hf.update({
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,  # legacy keys: read by transformers 4 and 5 alike
        "rope_scaling": None,
        "torch_dtype": "float32",
    })
    if cfg.rope_scaling_factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **LLAMA3_ROPE}
    hf.setdefault("max_position_embeddings", 8192 if cfg.rope_scaling_factor == 1.0
                  else int(LLAMA3_ROPE["original_max_position_embeddings"] * cfg.rope_scaling_factor))
    if model_type == "llama":
        hf.update({"attention_bias": False, "mlp_bias": False})
    if model_type in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.sliding_window or None
    if model_type == "qwen2":  # the window on every layer or on none (transformers reads layer_types first)
        hf["use_sliding_window"] = bool(cfg.sliding_window)
        if cfg.sliding_window:
            hf.update({"sliding_window": cfg.sliding_window, "max_window_layers": 0,
                       "layer_types": ["sliding_attention"] * cfg.num_layers})
        elif "layer_types" in hf:
            hf["layer_types"] = ["full_attention"] * cfg.num_layers
    if model_type == "mixtral":
        hf.update({"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
                   "router_aux_loss_coef": cfg.moe_aux_loss_coeff})
    return hf


# ------------------------------------------------------------------------------------------------ tensors
def _expected_shapes(cfg: ModelConfig) -> Shapes:
    """Every HF tensor ``cfg`` implies, dimension by dimension, with the config.json key each size comes from."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    d, vocab = Size("hidden_size", cfg.hidden_size), Size("vocab_size", cfg.vocab_size)
    q = Size("num_attention_heads", cfg.num_attention_heads, hd, f"head_dim {hd}")
    kv = Size("num_key_value_heads", cfg.kv_heads, hd, f"head_dim {hd}")
    ffn = Size("intermediate_size", cfg.ffn_hidden_size)
    out: Shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        hf, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out.update({hf + "input_layernorm.weight": (d,), hf + "post_attention_layernorm.weight": (d,),
                    att + "q_proj.weight": (q, d), att + "k_proj.weight": (kv, d), att + "v_proj.weight": (kv, d),
                    att + "q_proj.bias": (q,), att + "k_proj.bias": (kv,), att + "v_proj.bias": (kv,),
                    att + "o_proj.weight": (d, q)})
        if cfg.num_experts:
            moe = hf + "block_sparse_moe."
            out[moe + "gate.weight"] = (Size("num_local_experts", cfg.num_experts), d)
            for e in range(cfg.num_experts):
                x = f"{moe}experts.{e}."
                out.update({x + "w1.weight": (ffn, d), x + "w3.weight": (ffn, d), x + "w2.weight": (d, ffn)})
        else:
            out.update({hf + "mlp.gate_proj.weight": (ffn, d), hf + "mlp.up_proj.weight": (ffn, d),
                        hf + "mlp.down_proj.weight": (d, ffn)})
    return out


def check_hf_weights(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, config_prefix: str = "") -> None:
    """The layer and expert counts and every shape ``cfg`` (read from config.json, whose keys are under
    ``config_prefix``) implies, against the tensors' shapes; ``UnsupportedHFConfig`` naming the key."""
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, r"model\.layers\.(\d+)\."),
                "layers (model.layers.<i>)", UnsupportedHFConfig, config_prefix)
    if cfg.num_experts:
        check_count("num_local_experts", cfg.num_experts,
                    indices(hf_tensors, r"model\.layers\.\d+\.block_sparse_moe\.experts\.(\d+)\."),
                    "experts (block_sparse_moe.experts.<e>)", UnsupportedHFConfig, config_prefix)
    check_shapes(_expected_shapes(cfg), hf_tensors, UnsupportedHFConfig, config_prefix)


def mmtrain_state_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                          config_prefix: str = "") -> dict[str, torch.Tensor]:
    """Full mmtrain tensors from full HF tensors (``model.*`` / ``lm_head.weight`` names), after
    ``check_hf_weights`` (``config_prefix``: where config.json holds the keys, e.g. LLaVA's ``text_config.``)."""
    check_hf_weights(hf_tensors, cfg, config_prefix)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_tensors:
            raise UnsupportedHFConfig(f"HF weights lack {name} (does config.json describe these weights?)")
        used.add(name)
        return hf_tensors[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf_tensors:  # some tied checkpoints store the shared tensor twice
        used.add("lm_head.weight")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[ours + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        out[ours + "mlp_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        att = hf + "self_attn."
        out[ours + "attn.qkv.weight"] = torch.cat([take(att + f"{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            out[ours + "attn.qkv.bias"] = torch.cat([take(att + f"{p}_proj.bias") for p in "qkv"])
        out[ours + "attn.proj.weight"] = take(att + "o_proj.weight")
        if cfg.num_experts:
            moe = hf + "block_sparse_moe."
            out[ours + "mlp.router.weight"] = take(moe + "gate.weight")
            experts = [f"{moe}experts.{e}." for e in range(cfg.num_experts)]
            out[ours + "mlp.experts.w_up"] = torch.stack(
                [torch.cat([take(x + "w1.weight"), take(x + "w3.weight")]).t() for x in experts]).contiguous()
            out[ours + "mlp.experts.w_down"] = torch.stack([take(x + "w2.weight").t() for x in experts]).contiguous()
        else:
            mlp = hf + "mlp."
            out[ours + "mlp.up.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
            out[ours + "mlp.down.weight"] = take(mlp + "down_proj.weight")
    # rotary_emb.inv_freq is a derived buffer some old checkpoints carry; anything else is a mapping gap
    unused = sorted(n for n in set(hf_tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise UnsupportedHFConfig(f"HF weights not mapped to mmtrain (unsupported architecture variant?): "
                                  f"{unused[:8]}")
    return out


def hf_state_from_mmtrain(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full HF tensors from full mmtrain tensors (the inverse of ``mmtrain_state_from_hf``)."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    qkv_sizes = [cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
    out = {"model.embed_tokens.weight": full["embed.weight"], "model.norm.weight": full["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = full["output.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[hf + "input_layernorm.weight"] = full[ours + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = full[ours + "mlp_norm.weight"]
        att = hf + "self_attn."
        for p, t in zip("qkv", full[ours + "attn.qkv.weight"].split(qkv_sizes)):
            out[att + f"{p}_proj.weight"] = t
        if cfg.qkv_bias:
            for p, t in zip("qkv", full[ours + "attn.qkv.bias"].split(qkv_sizes)):
                out[att + f"{p}_proj.bias"] = t
        out[att + "o_proj.weight"] = full[ours + "attn.proj.weight"]
        if cfg.num_experts:
            moe = hf + "block_sparse_moe."
            out[moe + "gate.weight"] = full[ours + "mlp.router.weight"]
            f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
            for e in range(cfg.num_experts):
                w1, w3 = full[ours + "mlp.experts.w_up"][e].t().split([f, f])
                out[f"{moe}experts.{e}.w1.weight"] = w1
                out[f"{moe}experts.{e}.w3.weight"] = w3
                out[f"{moe}experts.{e}.w2.weight"] = full[ours + "mlp.experts.w_down"][e].t()
        else:
            gate, up = full[ours + "mlp.up.weight"].split([cfg.ffn_hidden_size] * 2)
            out[hf + "mlp.gate_proj.weight"] = gate
            out[hf + "mlp.up_proj.weight"] = up
            out[hf + "mlp.down_proj.weight"] = full[ours + "mlp.down.weight"]
    return {k: v.contiguous() for k, v in out.items()}

