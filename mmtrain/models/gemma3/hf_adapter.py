"""Hugging Face ``Gemma3ForCausalLM`` (``model_type: gemma3_text``) <-> this family: config.json and full
(unsharded) state dicts.

Tensors map one to one, bit for bit, except two row-wise fusions: ``attn.qkv`` = [q_proj | k_proj | v_proj] and
``mlp.up`` = [gate_proj | up_proj]. Norm weights are stored as HF stores them (the offset from one).

RoPE parameters are read in both forms transformers 5 accepts: ``rope_parameters`` keyed by layer type
(``full_attention`` / ``sliding_attention``, what ``save_pretrained`` writes now) and the older ``rope_theta`` +
``rope_local_base_freq`` + ``rope_scaling`` (the global layers'), which fill in what the first leaves out, as
transformers does; the export writes both, consistently. Layer kinds come from ``layer_types``, else from
``sliding_window_pattern`` (default 6, as transformers).

Strict both ways: a missing, unexpected or misshapen tensor and an HF option this model lacks are
``HFAdapterError``\\ s naming the key. ``attn_logit_softcapping`` is refused: transformers' Gemma 3 attention never
applies it, so weights trained there computed without it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.models.gemma3.config import GLOBAL, LOCAL, Gemma3Config
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, indices
from mmtrain.models.hf_tensors import TakenTensors, embedding_norm_and_head

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "sliding_window")
_SAME_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "sliding_window")
# HF options this model computes only at one value (absent keys take transformers' default, which is that value)
_FIXED = {"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,), "attention_dropout": (0, 0.0),
          "use_bidirectional_attention": (False, None), "attn_logit_softcapping": (None,)}
_NAMES = {"attn_norm.weight": "input_layernorm.weight", "post_attn_norm.weight": "post_attention_layernorm.weight",
          "mlp_norm.weight": "pre_feedforward_layernorm.weight",
          "post_mlp_norm.weight": "post_feedforward_layernorm.weight", "attn.q_norm.weight": "self_attn.q_norm.weight",
          "attn.k_norm.weight": "self_attn.k_norm.weight", "attn.proj.weight": "self_attn.o_proj.weight",
          "mlp.down.weight": "mlp.down_proj.weight"}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


class HFAdapterError(ValueError):
    """An HF config or state dict this family cannot map exactly; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------------ config
def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE parameters as transformers 5 resolves them from either form."""
    nested = hf.get("rope_parameters")
    if nested is not None and not (isinstance(nested, dict) and set(nested) <= {GLOBAL, LOCAL}):
        raise HFAdapterError("config.json: rope_parameters must map full_attention / sliding_attention to their "
                             f"RoPE parameters (Gemma 3's per-layer-type form), got {nested!r}")
    nested = nested or {}
    full = {"rope_type": "default", **(nested.get(GLOBAL) or {}), **(hf.get("rope_scaling") or {})}
    local = {"rope_type": "default", **(nested.get(LOCAL) or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    for params in (full, local):
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return full, local


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HFAdapterError(f"config.json: {key}={value!r} must be a positive number")
    return float(value)


def config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """Our config for an HF ``config.json`` mapping (checked); ``HFAdapterError`` names an unusable key."""
    if hf.get("model_type") != MODEL_TYPE:
        raise HFAdapterError(f"config.json: model_type={hf.get('model_type')!r}; this adapter reads {MODEL_TYPE!r} "
                             "(Gemma3ForCausalLM, the text model)")
    missing = [k for k in _INT_KEYS if hf.get(k) is None]
    if missing:
        raise HFAdapterError(f"config.json lacks {missing[0]!r}; write the key out (transformers' save_pretrained "
                             "does)")
    for key in _INT_KEYS:
        config_int(hf, key, HFAdapterError)
    for key, allowed in _FIXED.items():
        if key in hf and hf[key] not in allowed:
            why = (": transformers' Gemma3 attention does not apply it, so these weights were trained without it"
                   if key == "attn_logit_softcapping" else "")
            raise HFAdapterError(f"config.json: {key}={hf[key]!r} is not supported{why}; supported: "
                                 f"{', '.join(map(repr, allowed))}")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = config_int(hf, "sliding_window_pattern", HFAdapterError, default=6)
        layer_types = [GLOBAL if (i + 1) % pattern == 0 else LOCAL for i in range(hf["num_hidden_layers"])]
    full, local = _rope(hf)
    if local["rope_type"] != "default":
        raise HFAdapterError(f"config.json: sliding_attention rope type {local['rope_type']!r} is not supported; "
                             "local layers use 'default'")
    if full["rope_type"] not in ("default", "linear"):
        raise HFAdapterError(f"config.json: full_attention rope type {full['rope_type']!r} is not supported; "
                             "supported: 'default', 'linear'")
    for params, which in ((full, GLOBAL), (local, LOCAL)):
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise HFAdapterError(f"config.json: {which} partial_rotary_factor={params['partial_rotary_factor']!r} "
                                 "is not supported; RoPE rotates the whole head")
    cap = hf.get("final_logit_softcapping")
    cfg = Gemma3Config(
        name=str(hf.get("_name_or_path") or "gemma3"), num_layers=hf["num_hidden_layers"],
        **{k: hf[k] for k in _SAME_KEYS}, layer_types=list(layer_types),
        query_pre_attn_scalar=_number(hf.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar"),
        rope_theta=_number(full["rope_theta"], "full_attention rope_theta"),
        rope_local_base_freq=_number(local["rope_theta"], "sliding_attention rope_theta"),
        rope_scaling="linear" if full["rope_type"] == "linear" else "none",
        rope_scaling_factor=_number(full.get("factor"), "full_attention factor") if full["rope_type"] == "linear"
        else 1.0,
        final_logit_softcapping=None if cap is None else _number(cap, "final_logit_softcapping"),
        rms_norm_eps=_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position_embeddings=config_int(hf, "max_position_embeddings", HFAdapterError, default=131_072))
    try:
        return cfg.check(prefix="config.json (mmtrain field) ")
    except ConfigError as exc:
        raise HFAdapterError(str(exc)) from None


def config_to_hf(cfg: Gemma3Config, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping; ``base`` (the config converted from, if any) supplies the fields this model
    does not use (token ids, initializer_range, ...). ``HFAdapterError`` for attention soft-capping, which
    ``Gemma3ForCausalLM`` would not apply."""
    if cfg.attn_logit_softcapping is not None:
        raise HFAdapterError(f"attn_logit_softcapping={cfg.attn_logit_softcapping}: transformers' Gemma3ForCausalLM "
                             "does not apply it, so the exported model would compute differently; train without it")
    legacy = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern",
              "_sliding_window_pattern")
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == MODEL_TYPE:
        hf.update({k: v for k, v in base.items() if k not in legacy})
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        full = {"rope_type": "linear", "factor": cfg.rope_scaling_factor, "rope_theta": cfg.rope_theta}
    scalar = cfg.query_pre_attn_scalar
    hf.update({k: getattr(cfg, k) for k in _SAME_KEYS})
    hf.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "num_hidden_layers": cfg.num_layers,
        "layer_types": list(cfg.layer_kinds()), "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "final_logit_softcapping": cfg.final_logit_softcapping, "attn_logit_softcapping": None,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "rope_parameters": {LOCAL: {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}, GLOBAL: full},
        # the older keys, equal to the above: read by transformers 4 (5 takes them only where the above is silent)
        "rope_theta": cfg.rope_theta, "rope_local_base_freq": cfg.rope_local_base_freq,
        "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"} if cfg.rope_scaling == "linear" else None,
    })
    return hf


# ------------------------------------------------------------------------------------------------ tensors
def _expected_shapes(cfg: Gemma3Config) -> Shapes:
    """Every HF tensor ``cfg`` implies, dimension by dimension, with the config.json key each size comes from."""
    d, vocab, ffn = Size("hidden_size", cfg.hidden_size), Size("vocab_size", cfg.vocab_size), Size(
        "intermediate_size", cfg.intermediate_size)
    hd = Size("head_dim", cfg.head_dim)
    unit = f"head_dim {cfg.head_dim}"
    q = Size("num_attention_heads", cfg.num_attention_heads, cfg.head_dim, unit)
    kv = Size("num_key_value_heads", cfg.num_key_value_heads, cfg.head_dim, unit)
    out: Shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        out.update({hf + name: (d,) for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                 "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")})
        out.update({hf + "self_attn.q_proj.weight": (q, d), hf + "self_attn.k_proj.weight": (kv, d),
                    hf + "self_attn.v_proj.weight": (kv, d), hf + "self_attn.o_proj.weight": (d, q),
                    hf + "self_attn.q_norm.weight": (hd,), hf + "self_attn.k_norm.weight": (hd,),
                    hf + "mlp.gate_proj.weight": (ffn, d), hf + "mlp.up_proj.weight": (ffn, d),
                    hf + "mlp.down_proj.weight": (d, ffn)})
    return out


def check_hf_weights(hf_tensors: dict[str, Any], cfg: Gemma3Config) -> None:
    """The layer count and every shape ``cfg`` (read from config.json) implies, against the tensors' shapes (only
    ``.shape`` is read); ``HFAdapterError`` naming the key."""
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, r"model\.layers\.(\d+)\."),
                "layers (model.layers.<i>)", HFAdapterError)
    check_shapes(_expected_shapes(cfg), hf_tensors, HFAdapterError)


def state_dict_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: Gemma3Config) -> dict[str, torch.Tensor]:
    """Full tensors of ``Gemma3Model(cfg)`` from full HF tensors, after ``check_hf_weights``. Every HF tensor is used
    or the call fails naming it."""
    check_hf_weights(hf_tensors, cfg)
    take = TakenTensors(hf_tensors, HFAdapterError)
    out = embedding_norm_and_head(take, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _NAMES.items():
            out[ours + mine] = take(hf + theirs)
        out[ours + "attn.qkv.weight"] = torch.cat([take(hf + n) for n in _QKV])
        out[ours + "mlp.up.weight"] = torch.cat([take(hf + n) for n in _UP])
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"HF state dict has {extra[0]!r} ({len(extra)} unused tensors), which "
                             f"{ARCHITECTURE} of this config.json does not hold")
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: Gemma3Config) -> dict[str, torch.Tensor]:
    """HF tensors (``Gemma3ForCausalLM``'s names) from our full tensors; every one of ours is used or the call
    fails naming it."""
    take = TakenTensors(state, HFAdapterError, "state dict")

    out = {"model.embed_tokens.weight": take("embed.weight"), "model.norm.weight": take("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("output.weight")
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _NAMES.items():
            out[hf + theirs] = take(ours + mine)
        for name, part in zip(_QKV, take(ours + "attn.qkv.weight").split([q, kv, kv])):
            out[hf + name] = part.contiguous()
        for name, part in zip(_UP, take(ours + "mlp.up.weight").split([cfg.intermediate_size] * 2)):
            out[hf + name] = part.contiguous()
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"state dict has {extra[0]!r}, which {ARCHITECTURE} does not hold")
    return out
