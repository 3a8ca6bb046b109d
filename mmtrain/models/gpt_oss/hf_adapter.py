"""Hugging Face ``GptOssForCausalLM`` <-> this family: config.json and full (unsharded) state dicts.

Tensors map one to one, bit for bit, except the fused attention projection: ``attn.qkv`` is [q_proj | k_proj |
v_proj] row-wise (weights and biases). The experts keep transformers' layout as it is (``gate_up_proj`` (E, D, 2F)
with gate and up interleaved, ``down_proj`` (E, F, D), their biases), so nothing is transposed or permuted.

Expert weights come dense (what transformers' ``save_pretrained`` writes for an unquantized model) or as the
Hub checkpoints store them, MXFP4: ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales``
(``config.json`` then has ``quantization_config.quant_method: mxfp4``). Those are dequantized at import to bf16
(``mxfp4.py``); the export writes dense experts in the checkpoint's dtype (bf16, or ``--dtype``) and no
``quantization_config``: nothing is quantized again.

Strict both ways: a missing, unexpected or misshapen tensor and an option this model lacks are
``HFAdapterError``\\ s naming the key. Before any tensor is read, the config's layer and expert counts and every
shape it implies are checked against the tensors' shapes (``mmtrain.models.hf_shapes``), naming the config key.
"""

from __future__ import annotations

from typing import Any

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.models.gpt_oss.mxfp4 import BYTES_PER_BLOCK, VALUES_PER_BLOCK, Mxfp4Error, dequantize
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, fixed, indices
from mmtrain.models.hf_tensors import TakenTensors, check_mapped_shapes, embedding_norm_and_head

ARCHITECTURE = "GptOssForCausalLM"
# config.json keys that must be there (the sizes) and their smallest values; HF's defaults fill in the others
_REQUIRED_INTS = {"vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
                  "num_key_value_heads": 1, "intermediate_size": 1, "num_local_experts": 1, "num_experts_per_tok": 1}
# our field -> (HF key, HF's default when absent: GptOssConfig's)
_OPTIONAL = {"attention_bias": ("attention_bias", True), "rms_norm_eps": ("rms_norm_eps", 1e-5),
             "tie_word_embeddings": ("tie_word_embeddings", False),
             "max_position_embeddings": ("max_position_embeddings", 131072),
             "swiglu_alpha": ("swiglu_alpha", 1.702), "swiglu_limit": ("swiglu_limit", 7.0)}
_YARN_KEYS = {"yarn_factor": "factor", "yarn_original_max_position_embeddings": "original_max_position_embeddings",
              "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_truncate": "truncate"}
_EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


class HFAdapterError(ValueError):
    """An HF config or state dict this family cannot map exactly; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------------ config
def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` over the transformers-4 ``rope_theta`` + ``rope_scaling``."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    params.setdefault("rope_theta", hf.get("rope_theta", 150000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _quantization(hf: dict[str, Any]) -> None:
    q = hf.get("quantization_config")
    if q is not None and (not isinstance(q, dict) or q.get("quant_method") != "mxfp4"):
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise HFAdapterError(f"config.json: quantization_config.quant_method={method!r} is not supported; "
                             "supported: 'mxfp4' (dequantized at import) or no quantization")


def _optional(hf: dict[str, Any], key: str, default: Any, prefix: str = "") -> Any:
    """``hf[key]`` (``default`` when absent), refused unless of the default's kind (bool, int, or a number);
    ``prefix``: where the key sits in config.json, for the message."""
    value = hf.get(key, default)
    kind = type(default)
    ok = isinstance(value, bool) if kind is bool else (
        not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind))
    if not ok:
        raise HFAdapterError(f"config.json: {prefix}{key}={value!r} must be "
                             f"{'a number' if kind is float else kind.__name__}")
    return kind(value)


def config_from_hf(hf: dict[str, Any]) -> GptOssConfig:
    """Our config for an HF ``config.json`` mapping (checked); ``HFAdapterError`` names an unusable key."""
    if hf.get("model_type") != "gpt_oss":
        raise HFAdapterError(f"config.json: model_type={hf.get('model_type')!r}; this adapter reads 'gpt_oss'")
    missing = [k for k in _REQUIRED_INTS if k not in hf]
    if missing:
        raise HFAdapterError(f"config.json lacks {missing[0]!r}; write the key out (transformers' "
                             "save_pretrained does)")
    for key, minimum in _REQUIRED_INTS.items():
        config_int(hf, key, HFAdapterError, minimum)
    if hf.get("attention_dropout", 0.0) not in (0, 0.0):
        raise HFAdapterError(f"config.json: attention_dropout={hf['attention_dropout']!r} is not supported; "
                             "supported: 0.0")
    _quantization(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]  # HF's default
    config_int({"head_dim": head_dim}, "head_dim", HFAdapterError, 2)
    window = hf.get("sliding_window", 128)
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise HFAdapterError(f"config.json: layer_types={layer_types!r} must be a list of strings")
    cfg = GptOssConfig(
        name=str(hf.get("_name_or_path") or "gpt_oss"), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"], head_dim=head_dim, intermediate_size=hf["intermediate_size"],
        num_local_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        sliding_window=0 if window is None else window, layer_types=list(layer_types or []),
        **{ours: _optional(hf, key, default) for ours, (key, default) in _OPTIONAL.items()})
    if window is not None:
        config_int({"sliding_window": window}, "sliding_window", HFAdapterError, 1)
    rope = _rope_parameters(hf)
    cfg.rope_theta = _optional(rope, "rope_theta", 0.0, "rope_parameters.")
    if rope["rope_type"] == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                raise HFAdapterError(f"config.json: rope_parameters.{key} is not supported; GPT-OSS's YaRN factor "
                                     "is derived from factor alone")
        if "original_max_position_embeddings" not in rope:
            raise HFAdapterError("config.json: rope_parameters.original_max_position_embeddings is required for yarn")
        config_int(rope, "original_max_position_embeddings", HFAdapterError, 1, prefix="rope_parameters.")
        if rope.get("factor") is None:  # as HF: the ratio of the target to the pretraining length
            rope["factor"] = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        rope.setdefault("truncate", True)  # transformers' default when the key is absent
        cfg.rope_scaling = "yarn"
        for ours, key in _YARN_KEYS.items():
            if rope.get(key) is not None:
                setattr(cfg, ours, _optional(rope, key, getattr(cfg, ours), "rope_parameters."))
    elif rope["rope_type"] == "default":
        cfg.rope_scaling = "none"
    else:
        raise HFAdapterError(f"config.json: rope type {rope['rope_type']!r} is not supported; supported: "
                             "'default', 'yarn'")
    try:
        return cfg.check(prefix="config.json (mmtrain field) ")
    except ConfigError as exc:
        raise HFAdapterError(str(exc)) from None


def config_to_hf(cfg: GptOssConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping; ``base`` (the config converted from, if any) supplies the fields this
    model does not use (token ids, initializer_range, ...); its ``quantization_config`` is dropped (the export
    is dense)."""
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == "gpt_oss":
        dropped = ("rope_parameters", "rope_scaling", "rope_theta", "quantization_config")
        hf.update({k: v for k, v in base.items() if k not in dropped})
    hf.update({
        "architectures": [ARCHITECTURE], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "num_local_experts": cfg.num_local_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": [cfg.layer_type(i) for i in range(cfg.num_layers)], "attention_dropout": 0.0,
        **{key: getattr(cfg, ours) for ours, (key, _) in _OPTIONAL.items()},
        "rope_theta": cfg.rope_theta, "rope_scaling": None,  # legacy keys: read by transformers 4 and 5 alike
    })
    if cfg.rope_scaling == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", **{key: getattr(cfg, ours) for ours, key in _YARN_KEYS.items()}}
    return hf


# ------------------------------------------------------------------------------------------------ tensors
_ATTENTION = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
              "attn.sinks": "self_attn.sinks", "mlp.router.weight": "mlp.router.weight",
              "mlp.router.bias": "mlp.router.bias", "mlp.experts.b_up": "mlp.experts.gate_up_proj_bias",
              "mlp.experts.b_down": "mlp.experts.down_proj_bias"}
_QKV = ("q_proj", "k_proj", "v_proj")


def _expected_shapes(cfg: GptOssConfig) -> Shapes:
    """Every HF tensor ``cfg`` implies (experts dense and MXFP4), dimension by dimension, with the config.json key
    each size comes from."""
    d, vocab = Size("hidden_size", cfg.hidden_size), Size("vocab_size", cfg.vocab_size)
    hd = f"head_dim {cfg.head_dim}"
    q = Size("num_attention_heads", cfg.num_attention_heads, cfg.head_dim, hd)
    kv = Size("num_key_value_heads", cfg.num_key_value_heads, cfg.head_dim, hd)
    e, f = Size("num_local_experts", cfg.num_local_experts), Size("intermediate_size", cfg.intermediate_size)
    f2 = Size("intermediate_size", cfg.intermediate_size, 2, "2 (gate, up)")
    d_blocks = Size(f"hidden_size / {VALUES_PER_BLOCK}", cfg.hidden_size // VALUES_PER_BLOCK)
    f_blocks = Size(f"intermediate_size / {VALUES_PER_BLOCK}", cfg.intermediate_size // VALUES_PER_BLOCK)
    out: Shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        hf, a, x = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.experts."
        out.update({hf + "input_layernorm.weight": (d,), hf + "post_attention_layernorm.weight": (d,),
                    a + "q_proj.weight": (q, d), a + "k_proj.weight": (kv, d), a + "v_proj.weight": (kv, d),
                    a + "o_proj.weight": (d, q), a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
                    a + "v_proj.bias": (kv,), a + "o_proj.bias": (d,),
                    a + "sinks": (Size("num_attention_heads", cfg.num_attention_heads),),
                    hf + "mlp.router.weight": (e, d), hf + "mlp.router.bias": (e,),
                    x + "gate_up_proj": (e, d, f2), x + "gate_up_proj_bias": (e, f2),
                    x + "down_proj": (e, f, d), x + "down_proj_bias": (e, d),
                    x + "gate_up_proj_blocks": (e, f2, d_blocks, fixed(BYTES_PER_BLOCK)),
                    x + "gate_up_proj_scales": (e, f2, d_blocks),
                    x + "down_proj_blocks": (e, d, f_blocks, fixed(BYTES_PER_BLOCK)),
                    x + "down_proj_scales": (e, d, f_blocks)})
    return out


def check_hf_weights(hf_tensors: dict[str, Any], cfg: GptOssConfig) -> None:
    """Layer count, MXFP4 divisibility and every shape ``cfg`` implies against the tensors' shapes (only
    ``.shape`` is read); ``HFAdapterError`` naming the config key."""
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, r"model\.layers\.(\d+)\."),
                "layers (model.layers.<i>)", HFAdapterError)
    for key, size in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
        if size % VALUES_PER_BLOCK and any(n.endswith("_blocks") for n in hf_tensors):
            raise HFAdapterError(f"config.json: {key}={size} is not a multiple of {VALUES_PER_BLOCK}, which MXFP4 "
                                 "expert blocks need; config.json and the weights disagree")
    check_shapes(_expected_shapes(cfg), hf_tensors, HFAdapterError)


def _experts(take, hf_tensors: dict[str, Any], prefix: str, projection: str) -> torch.Tensor:
    """One expert projection (E, in, out) of layer ``prefix``: dense as stored, or MXFP4 dequantized to bf16."""
    dense, blocks, scales = prefix + projection, f"{prefix}{projection}_blocks", f"{prefix}{projection}_scales"
    if dense in hf_tensors:
        if blocks in hf_tensors or scales in hf_tensors:
            raise HFAdapterError(f"HF state dict holds both {dense!r} and its MXFP4 {projection}_blocks/_scales; "
                                 "keep one form")
        return take(dense)
    if blocks not in hf_tensors and scales not in hf_tensors:
        raise HFAdapterError(f"HF state dict lacks {dense!r} (or its MXFP4 {projection}_blocks and _scales)")
    try:
        return dequantize(prefix + projection, take(blocks), take(scales))
    except Mxfp4Error as exc:
        raise HFAdapterError(str(exc)) from None


def state_dict_from_hf(hf_tensors: dict[str, Any], cfg: GptOssConfig) -> dict[str, torch.Tensor]:
    """Full tensors of ``GptOssModel(cfg)`` (its ``state_dict`` names) from full HF tensors, after
    ``check_hf_weights``. Every HF tensor is used or the call fails naming it."""
    check_hf_weights(hf_tensors, cfg)
    take = TakenTensors(hf_tensors, HFAdapterError)
    out = embedding_norm_and_head(take, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _ATTENTION.items():
            out[ours + mine] = take(hf + theirs)
        a = hf + "self_attn."
        out[ours + "attn.qkv.weight"] = torch.cat([take(f"{a}{p}.weight") for p in _QKV])
        out[ours + "attn.proj.weight"] = take(a + "o_proj.weight")
        if cfg.attention_bias:
            out[ours + "attn.qkv.bias"] = torch.cat([take(f"{a}{p}.bias") for p in _QKV])
            out[ours + "attn.proj.bias"] = take(a + "o_proj.bias")
        x = hf + "mlp.experts."
        out[ours + "mlp.experts.w_up"] = _experts(take, hf_tensors, x, "gate_up_proj")
        out[ours + "mlp.experts.w_down"] = _experts(take, hf_tensors, x, "down_proj")
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"HF state dict has {extra[0]!r} ({len(extra)} unused tensors), which this model does "
                             "not hold")
    _check_shapes(out, cfg)
    return out


def _check_shapes(out: dict[str, torch.Tensor], cfg) -> None:
    """The mapped tensors against the shapes of a model built from ``cfg`` (the model module loads only when a conversion runs)."""
    from mmtrain.models.gpt_oss.model import GptOssModel

    check_mapped_shapes(out, lambda: GptOssModel(cfg), HFAdapterError)


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: GptOssConfig) -> dict[str, torch.Tensor]:
    """HF tensors (dense experts: no MXFP4) from our full tensors."""
    take = TakenTensors(state, HFAdapterError, "state dict")

    out = {"model.embed_tokens.weight": take("embed.weight"), "model.norm.weight": take("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("output.weight")
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _ATTENTION.items():
            out[hf + theirs] = take(ours + mine)
        a = hf + "self_attn."
        for p, part in zip(_QKV, take(ours + "attn.qkv.weight").split([q, kv, kv])):
            out[f"{a}{p}.weight"] = part.contiguous()
        out[a + "o_proj.weight"] = take(ours + "attn.proj.weight")
        if cfg.attention_bias:
            for p, part in zip(_QKV, take(ours + "attn.qkv.bias").split([q, kv, kv])):
                out[f"{a}{p}.bias"] = part.contiguous()
            out[a + "o_proj.bias"] = take(ours + "attn.proj.bias")
        out[hf + "mlp.experts.gate_up_proj"] = take(ours + "mlp.experts.w_up")
        out[hf + "mlp.experts.down_proj"] = take(ours + "mlp.experts.w_down")
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"state dict has {extra[0]!r}, which GptOssForCausalLM does not hold")
    return out
