"""Hugging Face Llama / Mistral / Qwen2 / Mixtral / Qwen3 / Qwen3-MoE <-> mmtrain: the config and parameter name
mappings.

Everything here works on *full* (unsharded) tensors keyed by name; splitting over TP/PP lives in
``checkpoint_io``. Our fused projections are concatenations of HF's separate ones, row-wise:
``attn.qkv`` = [q_proj | k_proj | v_proj] (heads in order, as HF stores them) and ``mlp.up`` =
[gate_proj | up_proj]. Both sides use the rotate-half RoPE convention, so no row permutation is needed.
Experts are stacked and transposed: ``experts.w_up[e]`` = [gate | up]^T (D, 2F), ``w_down[e]`` = down^T
(Mixtral's w1, w3, w2 under ``block_sparse_moe.``; Qwen3-MoE's gate_proj, up_proj, down_proj under ``mlp.``).
Qwen3's per-head q/k RMSNorms are ``attn.q_norm`` / ``attn.k_norm`` (``qk_norm``); which HF model type a config
is written as follows from the shape (``_hf_model_type_of``).
Mistral is the Llama layout with a sliding window (``model.sliding_window``); Mixtral's, Qwen2's, Qwen3's and
Qwen3-MoE's windows map to the same field when every layer has it (Qwen2's / Qwen3's ``use_sliding_window`` with all
layers past ``max_window_layers``; Qwen3-MoE's ``use_sliding_window`` slides every layer).
Before any tensor is mapped, the config's layer and expert counts and every shape it implies are checked against
the tensors' shapes (``mmtrain.models.hf_shapes``): a contradiction is one ``UnsupportedHFConfig`` naming the key.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, indices

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# an MoE layer's HF tensors: the module under the layer, and an expert's (gate, up, down) linears
_MOE_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
              "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}
# model types whose window is switched on by use_sliding_window, and those of them with per-layer kinds
_QWEN_WINDOW_TYPES, _LAYERED_WINDOW_TYPES = ("qwen2", "qwen3", "qwen3_moe"), ("qwen2", "qwen3")
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


def _qwen3_moe_dense_layers(hf: dict[str, Any], layers: int) -> list[int]:
    """The layers of a ``qwen3_moe`` config that keep a dense MLP: those in ``mlp_only_layers`` and those
    ``decoder_sparse_step`` skips (layer i has experts when (i + 1) % step == 0, as transformers builds it)."""
    step = config_int(hf, "decoder_sparse_step", UnsupportedHFConfig, default=1)
    listed = hf.get("mlp_only_layers") or []
    if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                           for i in listed):
        raise UnsupportedHFConfig(f"config.json: mlp_only_layers={listed!r} must be a list of layer indices "
                                  f"0..{layers - 1}")
    dense = sorted({i for i in range(layers) if i in listed or (i + 1) % step})
    if len(dense) == layers:
        raise UnsupportedHFConfig(f"config.json: mlp_only_layers={listed!r} with decoder_sparse_step={step} leave "
                                  f"no MoE layer of {layers}; convert a dense model as model_type qwen3")
    return dense


def _dense_layers_as_hf(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """``decoder_sparse_step`` and ``mlp_only_layers`` for ``cfg.moe_dense_layers``: the source config's pair
    when it says the same (an exact round trip), else step 1 and the list."""
    try:
        if _qwen3_moe_dense_layers(base, cfg.num_layers) == sorted(cfg.moe_dense_layers):
            return {"decoder_sparse_step": base.get("decoder_sparse_step", 1),
                    "mlp_only_layers": base.get("mlp_only_layers") or []}
    except UnsupportedHFConfig:
        pass
    return {"decoder_sparse_step": 1, "mlp_only_layers": sorted(cfg.moe_dense_layers)}


def _window_from_hf(hf: dict[str, Any], model_type: str) -> int:
    """``model.sliding_window`` (0 = none) from Mistral's / Mixtral's ``sliding_window``, Qwen3-MoE's
    ``use_sliding_window`` + ``sliding_window`` (every layer), or Qwen2's / Qwen3's ``use_sliding_window`` +
    ``sliding_window`` on the layers ``layer_types`` (else ``max_window_layers``) marks."""
    if model_type == "llama":
        return 0  # LlamaForCausalLM has no window, whatever the file holds
    if model_type in _QWEN_WINDOW_TYPES and not hf.get("use_sliding_window", False):
        return 0  # transformers drops a Qwen window unless use_sliding_window
    if hf.get("sliding_window") is None:
        return 0
    window = config_int(hf, "sliding_window", UnsupportedHFConfig)
    if model_type not in _LAYERED_WINDOW_TYPES:
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
    experts_key = "num_local_experts" if model_type == "mixtral" or "num_experts" not in hf else "num_experts"
    both = {"num_experts", "num_local_experts"} <= hf.keys()
    if model_type == "qwen3_moe" and both and hf["num_experts"] != hf["num_local_experts"]:
        raise UnsupportedHFConfig(f"config.json: num_experts={hf['num_experts']!r} and num_local_experts="
                                  f"{hf['num_local_experts']!r} disagree")
    if model_type in _MOE_NAMES:  # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
        config_int(hf, experts_key, UnsupportedHFConfig)
        config_int(hf, "num_experts_per_tok", UnsupportedHFConfig)
    if model_type == "qwen3_moe":
        config_int(hf, "moe_intermediate_size", UnsupportedHFConfig)
    heads = hf["num_attention_heads"]
    # transformers' default when config.json has no head_dim: 128 for Qwen3 (its config class), else the width
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else hf["hidden_size"] // heads)
    theta, factor = _rope_from_hf(hf)
    kv_heads = hf.get("num_key_value_heads") or heads
    cfg = ModelConfig(
        name=hf.get("_name_or_path") or model_type,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=0 if kv_heads == heads else kv_heads,
        head_dim=0 if head_dim * heads == hf["hidden_size"] else head_dim,
        vocab_size=hf["vocab_size"],
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        rope_theta=theta,
        rope_scaling_factor=factor,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=_window_from_hf(hf, model_type),
    )
    if model_type in _MOE_NAMES:  # softmax top-k; the aux loss weight as configured (output_router_logits: unused)
        cfg.num_experts = hf[experts_key]
        cfg.moe_top_k = hf["num_experts_per_tok"]
        cfg.moe_router = "softmax"
        cfg.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.01 if model_type == "mixtral" else 0.001))
    if model_type == "qwen3_moe":
        cfg.moe_ffn_hidden_size = hf["moe_intermediate_size"]
        cfg.moe_norm_topk_prob = bool(hf.get("norm_topk_prob", False))
        cfg.moe_dense_layers = _qwen3_moe_dense_layers(hf, cfg.num_layers)
    return cfg


def _hf_model_type_of(cfg: ModelConfig, base: dict[str, Any] | None = None) -> str:
    """Qwen3-MoE (experts and q/k norms), Mixtral (experts), Qwen3 (q/k norms), Qwen2 (q/k/v biases), Mistral (a
    window, or converted from a Mistral), else Llama."""
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window or (base or {}).get("model_type") == "mistral" else "llama"


def hf_config_from_model_config(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping for ``cfg``. ``base`` (the config the checkpoint was converted from, if
    any) supplies the fields mmtrain does not model, e.g. token ids and max_position_embeddings."""
    unsupported = {"norm": ("rmsnorm",), "activation": ("swiglu",), "add_bias": (False,)}
    if cfg.qk_norm:  # Qwen3: no q/k/v biases
        unsupported["qkv_bias"] = (False,)
    if cfg.num_experts:
        unsupported.update({"moe_shared_ffn_hidden_size": (0,), "moe_router": ("softmax",)})
    if cfg.num_experts and not cfg.qk_norm:  # Mixtral: every layer routed, weights renormalized
        unsupported.update({"moe_norm_topk_prob": (True,), "moe_dense_layers": ([],)})
    for key, allowed in unsupported.items():
        if getattr(cfg, key) not in allowed:
            raise UnsupportedHFConfig(f"model.{key}={getattr(cfg, key)!r} has no Llama/Qwen2/Qwen3/Mixtral "
                                      f"equivalent; supported: {', '.join(map(repr, allowed))}")
    if cfg.num_experts and not cfg.qk_norm and cfg.moe_ffn_hidden_size not in (0, cfg.ffn_hidden_size):
        raise UnsupportedHFConfig("model.moe_ffn_hidden_size must be 0 or equal ffn_hidden_size for Mixtral")
    model_type = _hf_model_type_of(cfg, base)
    hf: dict[str, Any] = {}
    same_type = base and base.get("model_type") == model_type
    if same_type:
        hf.update({k: v for k, v in base.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")})
    hf.update({
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.attention_head_dim,
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
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        hf.update({"attention_bias": False})
    if model_type == "llama":
        hf.update({"mlp_bias": False})
    if model_type in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.sliding_window or None
    if model_type in _QWEN_WINDOW_TYPES:  # the window on every layer or on none (transformers reads layer_types first)
        hf["use_sliding_window"] = bool(cfg.sliding_window)
        if cfg.sliding_window:
            hf["sliding_window"] = cfg.sliding_window
        if cfg.sliding_window and model_type in _LAYERED_WINDOW_TYPES:
            hf.update({"max_window_layers": 0, "layer_types": ["sliding_attention"] * cfg.num_layers})
        elif "layer_types" in hf:
            hf["layer_types"] = ["full_attention"] * cfg.num_layers
    if model_type == "mixtral":
        hf.update({"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
                   "router_aux_loss_coef": cfg.moe_aux_loss_coeff})
    if model_type == "qwen3_moe":  # "num_experts", the Hub's key (transformers 5 reads it as num_local_experts)
        hf.pop("num_local_experts", None)
        hf.update({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k,
                   "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                   "norm_topk_prob": cfg.moe_norm_topk_prob, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
                   **_dense_layers_as_hf(cfg, base if same_type else {})})
    return hf


# ------------------------------------------------------------------------------------------------ tensors
def _expected_shapes(cfg: ModelConfig) -> Shapes:
    """Every HF tensor ``cfg`` implies, dimension by dimension, with the config.json key each size comes from."""
    hd = cfg.attention_head_dim
    d, vocab = Size("hidden_size", cfg.hidden_size), Size("vocab_size", cfg.vocab_size)
    q = Size("num_attention_heads", cfg.num_attention_heads, hd, f"head_dim {hd}")
    kv = Size("num_key_value_heads", cfg.kv_heads, hd, f"head_dim {hd}")
    ffn = Size("intermediate_size", cfg.ffn_hidden_size)
    model_type = _hf_model_type_of(cfg)
    expert_ffn = (Size("moe_intermediate_size", cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
                  if model_type == "qwen3_moe" else ffn)
    out: Shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        hf, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out.update({hf + "input_layernorm.weight": (d,), hf + "post_attention_layernorm.weight": (d,),
                    att + "q_proj.weight": (q, d), att + "k_proj.weight": (kv, d), att + "v_proj.weight": (kv, d),
                    att + "q_proj.bias": (q,), att + "k_proj.bias": (kv,), att + "v_proj.bias": (kv,),
                    att + "o_proj.weight": (d, q)})
        head = Size("head_dim", hd)
        out.update({att + "q_norm.weight": (head,), att + "k_norm.weight": (head,)})
        if cfg.moe_layer(i):
            moe, (gate, up, down) = hf + _MOE_NAMES[model_type][0], _MOE_NAMES[model_type][1]
            out[moe + "gate.weight"] = (Size(_experts_key(model_type), cfg.num_experts), d)
            for e in range(cfg.num_experts):
                x = f"{moe}experts.{e}."
                out.update({f"{x}{gate}.weight": (expert_ffn, d), f"{x}{up}.weight": (expert_ffn, d),
                            f"{x}{down}.weight": (d, expert_ffn)})
        else:
            out.update({hf + "mlp.gate_proj.weight": (ffn, d), hf + "mlp.up_proj.weight": (ffn, d),
                        hf + "mlp.down_proj.weight": (d, ffn)})
    return out


def _experts_key(model_type: str) -> str:
    return "num_local_experts" if model_type == "mixtral" else "num_experts"


def check_hf_weights(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, config_prefix: str = "") -> None:
    """The layer and expert counts and every shape ``cfg`` (read from config.json, whose keys are under
    ``config_prefix``) implies, against the tensors' shapes; ``UnsupportedHFConfig`` naming the key."""
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, r"model\.layers\.(\d+)\."),
                "layers (model.layers.<i>)", UnsupportedHFConfig, config_prefix)
    if cfg.num_experts:
        model_type = _hf_model_type_of(cfg)
        where = _MOE_NAMES[model_type][0]
        check_count(_experts_key(model_type), cfg.num_experts,
                    indices(hf_tensors, rf"model\.layers\.\d+\.{re.escape(where)}experts\.(\d+)\."),
                    f"experts ({where}experts.<e>)", UnsupportedHFConfig, config_prefix)
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
    model_type = _hf_model_type_of(cfg)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[ours + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        out[ours + "mlp_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        att = hf + "self_attn."
        out[ours + "attn.qkv.weight"] = torch.cat([take(att + f"{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            out[ours + "attn.qkv.bias"] = torch.cat([take(att + f"{p}_proj.bias") for p in "qkv"])
        out[ours + "attn.proj.weight"] = take(att + "o_proj.weight")
        if cfg.qk_norm:
            out[ours + "attn.q_norm.weight"] = take(att + "q_norm.weight")
            out[ours + "attn.k_norm.weight"] = take(att + "k_norm.weight")
        if cfg.moe_layer(i):
            moe, (gate, up, down) = hf + _MOE_NAMES[model_type][0], _MOE_NAMES[model_type][1]
            out[ours + "mlp.router.weight"] = take(moe + "gate.weight")
            experts = [f"{moe}experts.{e}." for e in range(cfg.num_experts)]
            out[ours + "mlp.experts.w_up"] = torch.stack(
                [torch.cat([take(f"{x}{gate}.weight"), take(f"{x}{up}.weight")]).t() for x in experts]).contiguous()
            out[ours + "mlp.experts.w_down"] = torch.stack(
                [take(f"{x}{down}.weight").t() for x in experts]).contiguous()
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
    hd = cfg.attention_head_dim
    qkv_sizes = [cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
    out = {"model.embed_tokens.weight": full["embed.weight"], "model.norm.weight": full["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = full["output.weight"]
    model_type = _hf_model_type_of(cfg)
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
        if cfg.qk_norm:
            out[att + "q_norm.weight"] = full[ours + "attn.q_norm.weight"]
            out[att + "k_norm.weight"] = full[ours + "attn.k_norm.weight"]
        if cfg.moe_layer(i):
            moe, (gate, up, down) = hf + _MOE_NAMES[model_type][0], _MOE_NAMES[model_type][1]
            out[moe + "gate.weight"] = full[ours + "mlp.router.weight"]
            f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
            for e in range(cfg.num_experts):
                w_gate, w_up = full[ours + "mlp.experts.w_up"][e].t().split([f, f])
                out[f"{moe}experts.{e}.{gate}.weight"] = w_gate
                out[f"{moe}experts.{e}.{up}.weight"] = w_up
                out[f"{moe}experts.{e}.{down}.weight"] = full[ours + "mlp.experts.w_down"][e].t()
        else:
            w_gate, w_up = full[ours + "mlp.up.weight"].split([cfg.ffn_hidden_size] * 2)
            out[hf + "mlp.gate_proj.weight"] = w_gate
            out[hf + "mlp.up_proj.weight"] = w_up
            out[hf + "mlp.down_proj.weight"] = full[ours + "mlp.down.weight"]
    return {k: v.contiguous() for k, v in out.items()}
