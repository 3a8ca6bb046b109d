"""Hugging Face ``NemotronHForCausalLM`` (``model_type: nemotron_h``) <-> this family: config.json and full
(unsharded) state dicts.

Tensors map one to one, bit for bit, under the same names inside a layer's ``mixer`` (the Mamba mixer's
``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``), except: an attention layer's
``qkv`` = [q_proj | k_proj | v_proj] row-wise and ``proj`` = ``o_proj``; an MLP layer's ``up`` / ``down`` =
``up_proj`` / ``down_proj``; ``model.embeddings`` / ``model.norm_f`` / ``lm_head`` = ``embed`` / ``norm`` /
``output``. Saved files (``save_pretrained``, the Hub's checkpoints) name the model ``backbone.*``, which
transformers renames to ``model.*`` when it loads them (its conversion mapping); both are read, ``backbone.*`` is
written. transformers' NemotronH never ties its output layer to the embedding (it always holds and saves
``lm_head.weight``), so a tied model is exported with ``lm_head.weight`` a copy of the embedding.

The layers come from ``layers_block_type`` (what transformers 5 writes; also read as ``layer_types`` and with the
legacy names ``mamba`` / ``attention``), else from ``hybrid_override_pattern`` (what the Hub's configs and Megatron
write); the export writes both, and ``num_hidden_layers``. The ``mamba_*`` aliases transformers accepts
(``mamba_n_groups``, ``mamba_d_conv``, ``mamba_chunk_size``, ``mamba_conv_bias``, ``mamba_dt_min``, ...) are read
the way it reads them (the alias wins). The dt clamp is read differently by the two transformers versions we
support: 5.24's mixer clamps ``dt`` to [``time_step_min``, inf] (its ``time_step_limit`` is read by nothing), 5.25's
to ``time_step_limit`` (``mamba_dt_limit``; default [0.0, inf]), as Mamba-2 itself does. The import follows
Mamba-2: ``time_step_limit`` where config.json has it (the Hub's configs: [0.0, inf], no clamp; their
``time_step_min`` 0.001 is only the init range), else [``time_step_min``, inf] (folders written for 5.24). The export
writes a clamp both versions apply alike: our limit's low end as ``time_step_min`` and ``time_step_limit`` [low, inf]
(which the folder writer puts into config.json as transformers does, inf as ``{"__float__": "Infinity"}``).

Strict both ways: a missing, unexpected or misshapen tensor and an HF option this model lacks are
``HFAdapterError``\\ s naming the key: mixture-of-experts layers (``moe`` / ``E``), multi-token prediction
(``num_nextn_predict_layers``), ``residual_in_fp32``, a ``sliding_window``, dropout, activations other than
relu2 / silu; the export refuses an upper dt limit (5.24's mixer has none). Keys transformers' model reads
nothing from (``attention_bias``, ``mamba_proj_bias``, ``expand``, ``use_mamba_kernels``,
``mamba_ssm_cache_dtype``, the MoE sizes of a model without MoE layers) are left as they are.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, indices
from mmtrain.models.hf_tensors import TakenTensors, check_mapped_shapes, embedding_norm_and_head
from mmtrain.models.nemotron_h.config import ATTENTION, MAMBA, MLP, PATTERN_LETTERS, NemotronHConfig

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"
SAVED_PREFIX = "backbone."  # the decoder's name in saved files (transformers renames it model. in memory)
# transformers' layer type names (layers_block_type) <-> pattern letters; legacy names as transformers remaps them
_LETTERS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_TYPES = {letter: name for name, letter in _LETTERS.items()}
# our field -> the alias transformers' NemotronHConfig also accepts (and prefers when both are given)
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
            "use_conv_bias": "mamba_conv_bias", "time_step_min": "mamba_dt_min", "time_step_max": "mamba_dt_max",
            "time_step_floor": "mamba_dt_init_floor", "time_step_limit": "mamba_dt_limit"}
# the integer keys each layer kind's tensors are shaped by: config.json must hold them
_SIZE_KEYS = {None: ("vocab_size", "hidden_size"),
              MAMBA: ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
              ATTENTION: ("num_attention_heads", "head_dim"), MLP: ("intermediate_size",)}
_OPTIONAL_INTS = ("num_key_value_heads", "chunk_size", "max_position_embeddings")
# transformers' defaults of the keys a config.json may leave out (those of layer kinds the pattern lacks too)
_HF_DEFAULTS = {"num_attention_heads": 32, "head_dim": 128, "intermediate_size": 21504, "mamba_num_heads": 128,
                "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
                "max_position_embeddings": 4096}
_BOOLS = ("use_conv_bias", "use_bias", "mlp_bias", "tie_word_embeddings", "rescale_prenorm_residual")
_FLOATS = {"layer_norm_epsilon": False, "time_step_max": False, "time_step_floor": True, "initializer_range": False}
# HF options this model computes only at one value (absent keys take transformers' default, which is that value)
_FIXED = {"mamba_hidden_act": ("silu",), "mlp_hidden_act": ("relu2",), "residual_in_fp32": (False,),
          "num_nextn_predict_layers": (0, None), "sliding_window": (None,), "attention_dropout": (0, 0.0),
          "hidden_dropout": (0, 0.0)}
_WHY = {"num_nextn_predict_layers": ": multi-token-prediction layers are not built (transformers' "
                                    "NemotronHForCausalLM does not build them either); set it to 0",
        "residual_in_fp32": ": the residual stream stays in the weights' dtype, as transformers computes it; set "
                            "it to false",
        "sliding_window": ": the attention layers attend to the whole sequence (transformers' NemotronH applies no "
                          "window either); set it to null"}
_MAMBA_NAMES = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
_QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
# how transformers writes an infinite float into config.json (strict JSON), and reads it back
_INFINITY = {"__float__": "Infinity"}
# transformers' defaults of the two dt clamp keys
_DEFAULT_TIME_STEP_MIN, _DEFAULT_TIME_STEP_LIMIT = 0.001, (0.0, math.inf)


class HFAdapterError(ValueError):
    """An HF config or state dict this family cannot map exactly; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------------ config
def _key(hf: dict[str, Any], field: str) -> str:
    """The config.json key ``field`` is read from: its alias when present (transformers prefers it)."""
    alias = _ALIASES.get(field)
    return alias if alias is not None and alias in hf else field


def _pattern(hf: dict[str, Any]) -> str:
    """The layers as a pattern string, from ``layers_block_type`` / ``layer_types`` or ``hybrid_override_pattern``."""
    key = next((k for k in ("layers_block_type", "layer_types") if hf.get(k) is not None), None)
    if key is not None:
        types = hf[key]
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise HFAdapterError(f"config.json: {key} must be a list of layer type names, got {types!r}")
        for i, name in enumerate(types):
            if _LEGACY_TYPES.get(name, name) not in _LETTERS:
                raise HFAdapterError(f"config.json: {key}[{i}]={name!r} is not a NemotronH layer type; use "
                                     f"{', '.join(map(repr, _LETTERS))}")
        pattern = "".join(_LETTERS[_LEGACY_TYPES.get(name, name)] for name in types)
    elif isinstance(hf.get("hybrid_override_pattern"), str):
        key, pattern = "hybrid_override_pattern", hf["hybrid_override_pattern"]
    else:
        raise HFAdapterError("config.json lacks layers_block_type (or hybrid_override_pattern); write the layers "
                             "out (transformers' save_pretrained does)")
    for i, letter in enumerate(pattern):
        if letter == "E":
            raise HFAdapterError(f"config.json: {key} layer {i} is a mixture-of-experts layer ('moe' / 'E'), "
                                 "which the nemotron_h family does not build yet")
        if letter not in _TYPES:
            raise HFAdapterError(f"config.json: {key} layer {i} is {letter!r}; use M, *, - (or E)")
    layers = hf.get("num_hidden_layers")
    if layers is not None and layers != len(pattern):
        raise HFAdapterError(f"config.json: num_hidden_layers={layers!r}, but {key} has {len(pattern)} layers; "
                             "make them agree")
    return pattern


def _number(hf: dict[str, Any], field: str, zero_ok: bool) -> float | None:
    """``hf``'s float ``field`` (via its alias) checked finite and positive (or >= 0); None when absent."""
    key = _key(hf, field)
    if key not in hf:
        return None
    value = hf[key]
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok)):
        raise HFAdapterError(f"config.json: {key}={value!r} must be a {'non-negative' if zero_ok else 'positive'} "
                             "number")
    return float(value)


def _limit_end(key: str, i: int, value: Any) -> float:
    """One end of config.json's ``time_step_limit``: a number, Infinity (Python's JSON) or transformers' tag."""
    if value == _INFINITY:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise HFAdapterError(f"config.json: {key}[{i}]={value!r} must be a number (Infinity, or "
                             f"{_INFINITY}, for no upper bound)")
    return float(value)


def _time_step_limit(hf: dict[str, Any]) -> tuple[float, float] | None:
    """The dt clamp transformers 5.25 applies: config.json's ``time_step_limit`` (its alias wins); None when absent
    (transformers' default then)."""
    key = _key(hf, "time_step_limit")
    if key not in hf:
        return None
    value = hf[key]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise HFAdapterError(f"config.json: {key}={value!r} must be [low, high]")
    low, high = (_limit_end(key, i, end) for i, end in enumerate(value))
    if not (math.isfinite(low) and low >= 0) or high <= low:
        raise HFAdapterError(f"config.json: {key}={[low, high]} must be [low, high] with 0 <= low < high")
    return low, high


def _dt_clamp(hf: dict[str, Any]) -> tuple[list[float | None], float | None]:
    """(our ``time_step_limit``, the init range's low end when config.json gives it): the dt clamp as Mamba-2 and
    transformers >= 5.25 apply it, ``time_step_limit`` (its alias wins), where config.json has one; else the clamp
    5.24 applied, [``time_step_min``, inf] (what folders without the key were written for)."""
    low = _number(hf, "time_step_min", zero_ok=True)
    limit = _time_step_limit(hf)
    if limit is None:
        clamp = _DEFAULT_TIME_STEP_MIN if low is None else low
        return [clamp, None], clamp if clamp > 0 else None  # 0 (no clamp) keeps our default init range
    return [limit[0], None if math.isinf(limit[1]) else limit[1]], low if low else None


def config_from_hf(hf: dict[str, Any]) -> NemotronHConfig:
    """Our config for an HF ``config.json`` mapping (checked); ``HFAdapterError`` names an unusable key."""
    if hf.get("model_type") != MODEL_TYPE:
        raise HFAdapterError(f"config.json: model_type={hf.get('model_type')!r}; this adapter reads {MODEL_TYPE!r} "
                             f"({ARCHITECTURE})")
    for key, allowed in _FIXED.items():
        if key in hf and hf[key] not in allowed:
            raise HFAdapterError(f"config.json: {key}={hf[key]!r} is not supported{_WHY.get(key, '')}; supported: "
                                 f"{', '.join(map(repr, allowed))}")
    pattern = _pattern(hf)
    kinds = {PATTERN_LETTERS[c] for c in pattern}
    fields: dict[str, Any] = {}
    for kind in (None, *sorted(kinds)):
        for field in _SIZE_KEYS.get(kind, ()):
            key = _key(hf, field)
            if hf.get(key) is None:
                raise HFAdapterError(f"config.json lacks {key!r}; write the key out (transformers' save_pretrained "
                                     "does)")
            fields[field] = config_int(hf, key, HFAdapterError)
    optional = [f for group in _SIZE_KEYS.values() for f in group if f not in fields] + list(_OPTIONAL_INTS)
    for field in optional:  # sizes of layer kinds the pattern lacks, the chunk size, ...: transformers' defaults
        key = _key(hf, field)
        fields[field] = config_int(hf, key, HFAdapterError) if hf.get(key) is not None else _HF_DEFAULTS.get(field)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]  # as transformers defaults it
    for field in _BOOLS:
        key = _key(hf, field)
        if key in hf:
            if not isinstance(hf[key], bool):
                raise HFAdapterError(f"config.json: {key}={hf[key]!r} must be true or false")
            fields[field] = hf[key]
    for field, zero_ok in _FLOATS.items():
        value = _number(hf, field, zero_ok)
        if value is not None:
            fields[field] = value
    fields["time_step_limit"], init_low = _dt_clamp(hf)
    if init_low is not None:
        fields["time_step_min"] = init_low
    cfg = NemotronHConfig(name=str(hf.get("_name_or_path") or "nemotron-h"), hybrid_override_pattern=pattern,
                          **fields)
    try:
        return cfg.check(prefix="config.json (mmtrain field) ")
    except ConfigError as exc:
        raise HFAdapterError(str(exc)) from None


def config_to_hf(cfg: NemotronHConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping; ``base`` (the config converted from, if any) supplies the fields this model
    does not use (token ids, MoE sizes, ...). ``HFAdapterError`` for an upper dt limit, which transformers 5.24's
    ``NemotronHForCausalLM`` would not apply."""
    low, high = cfg.time_step_limit
    if high is not None:
        raise HFAdapterError(f"time_step_limit={cfg.time_step_limit}: transformers 5.24's NemotronHForCausalLM "
                             "clamps dt only from below (at time_step_min), so the exported model would compute "
                             "differently; train with time_step_limit=[low, null]")
    rewritten = {*_ALIASES.values(), "layers_block_type", "layer_types", "hybrid_override_pattern"}
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == MODEL_TYPE:
        hf.update({k: v for k, v in base.items() if k not in rewritten})
    pattern = cfg.hybrid_override_pattern
    hf.update({k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "mlp_hidden_act", "mlp_bias", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
        "conv_kernel", "chunk_size", "use_conv_bias", "use_bias", "mamba_hidden_act", "time_step_max",
        "time_step_floor", "layer_norm_epsilon", "tie_word_embeddings", "max_position_embeddings",
        "initializer_range", "rescale_prenorm_residual")})
    hf.update({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "layers_block_type": [_TYPES[c] for c in pattern], "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern), "residual_in_fp32": False,
        # the clamp both transformers versions apply: 5.24 reads time_step_min, 5.25 time_step_limit
        "time_step_min": float(low), "time_step_limit": [float(low), math.inf],
        "num_nextn_predict_layers": 0, "sliding_window": None, "attention_bias": False, "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    })
    return hf


# ------------------------------------------------------------------------------------------------ tensors
def _prefix(hf_tensors) -> str:
    """The name of the decoder in these HF tensors: ``backbone.`` in saved files, ``model.`` in memory."""
    return SAVED_PREFIX if any(name.startswith(SAVED_PREFIX) for name in hf_tensors) else "model."


def _expected_shapes(cfg: NemotronHConfig, prefix: str) -> Shapes:
    """Every HF tensor ``cfg`` implies (the decoder's under ``prefix``), dimension by dimension, with the
    config.json key each size comes from. Within a Mamba layer the tensors that pin one key come first (A_log: the
    heads, norm: the head width), so the composite sizes after them point at what is left."""
    d, vocab = Size("hidden_size", cfg.hidden_size), Size("vocab_size", cfg.vocab_size)
    H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    heads = Size("mamba_num_heads", H)
    inner = Size("mamba_head_dim", P, H, f"mamba_num_heads {H}")
    conv = Size("mamba_num_heads*mamba_head_dim + 2*n_groups*ssm_state_size", H * P + 2 * G * N)
    proj = Size("2*mamba_num_heads*mamba_head_dim + 2*n_groups*ssm_state_size + mamba_num_heads",
                2 * H * P + 2 * G * N + H)
    hd = cfg.head_dim
    q = Size("num_attention_heads", cfg.num_attention_heads, hd, f"head_dim {hd}")
    kv = Size("num_key_value_heads", cfg.num_key_value_heads, hd, f"head_dim {hd}")
    ffn = Size("intermediate_size", cfg.intermediate_size)
    out: Shapes = {f"{prefix}embeddings.weight": (vocab, d), "lm_head.weight": (vocab, d),
                   f"{prefix}norm_f.weight": (d,)}
    for i, kind in enumerate(cfg.layer_kinds()):
        hf = f"{prefix}layers.{i}."
        out[hf + "norm.weight"] = (d,)
        m = hf + "mixer."
        if kind == MAMBA:
            out.update({m + "A_log": (heads,), m + "dt_bias": (heads,), m + "D": (heads,), m + "norm.weight": (inner,),
                        m + "out_proj.weight": (d, inner), m + "out_proj.bias": (d,),
                        m + "conv1d.weight": (conv, Size("", 1), Size("conv_kernel", cfg.conv_kernel)),
                        m + "conv1d.bias": (conv,), m + "in_proj.weight": (proj, d), m + "in_proj.bias": (proj,)})
        elif kind == ATTENTION:
            out.update({m + "q_proj.weight": (q, d), m + "k_proj.weight": (kv, d), m + "v_proj.weight": (kv, d),
                        m + "o_proj.weight": (d, q)})
        else:
            out.update({m + "up_proj.weight": (ffn, d), m + "up_proj.bias": (ffn,), m + "down_proj.weight": (d, ffn),
                        m + "down_proj.bias": (d,)})
    return out


def check_hf_weights(hf_tensors: dict[str, Any], cfg: NemotronHConfig) -> None:
    """The layer count and every shape ``cfg`` (read from config.json) implies, against the tensors' shapes (only
    ``.shape`` is read); ``HFAdapterError`` naming the key."""
    prefix = _prefix(hf_tensors)
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, re.escape(prefix) + r"layers\.(\d+)\."),
                f"layers ({prefix}layers.<i>)", HFAdapterError)
    check_shapes(_expected_shapes(cfg, prefix), hf_tensors, HFAdapterError)


def _layer_names(cfg: NemotronHConfig, kind: str) -> list[tuple[str, str]]:
    """(our name, HF name) inside ``layers.<i>.mixer`` of one layer of ``kind``, but the fused qkv."""
    if kind == MAMBA:
        names = list(_MAMBA_NAMES) + (["in_proj.bias", "out_proj.bias"] if cfg.use_bias else [])
        names += ["conv1d.bias"] if cfg.use_conv_bias else []
        return [(n, n) for n in names]
    if kind == ATTENTION:
        return [("proj.weight", "o_proj.weight")]
    pairs = [("up.weight", "up_proj.weight"), ("down.weight", "down_proj.weight")]
    return pairs + ([("up.bias", "up_proj.bias"), ("down.bias", "down_proj.bias")] if cfg.mlp_bias else [])


def state_dict_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: NemotronHConfig) -> dict[str, torch.Tensor]:
    """Full tensors of ``NemotronHModel(cfg)`` from full HF tensors, after ``check_hf_weights``. Every HF tensor
    is used or the call fails naming it."""
    check_hf_weights(hf_tensors, cfg)
    take, prefix = TakenTensors(hf_tensors, HFAdapterError), _prefix(hf_tensors)
    out = embedding_norm_and_head(take, cfg.tie_word_embeddings, embed=f"{prefix}embeddings.weight",
                                  norm=f"{prefix}norm_f.weight")
    for i, kind in enumerate(cfg.layer_kinds()):
        hf, ours = f"{prefix}layers.{i}.", f"layers.{i}."
        out[ours + "norm.weight"] = take(hf + "norm.weight")
        for mine, theirs in _layer_names(cfg, kind):
            out[ours + "mixer." + mine] = take(hf + "mixer." + theirs)
        if kind == ATTENTION:
            out[ours + "mixer.qkv.weight"] = torch.cat([take(hf + "mixer." + n) for n in _QKV])
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"HF state dict has {extra[0]!r} ({len(extra)} unused tensors), which "
                             f"{ARCHITECTURE} of this config.json does not hold")
    _check_mapped_shapes(out, cfg)
    return out


def _check_mapped_shapes(out: dict[str, torch.Tensor], cfg: NemotronHConfig) -> None:
    """The mapped tensors against the shapes of a model built from ``cfg`` (the model module loads only when a
    conversion runs)."""
    from mmtrain.models.nemotron_h.model import NemotronHModel

    check_mapped_shapes(out, lambda: NemotronHModel(cfg), HFAdapterError)


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: NemotronHConfig) -> dict[str, torch.Tensor]:
    """HF tensors (``NemotronHForCausalLM``'s names as saved files hold them: ``backbone.*``) from our full
    tensors; every one of ours is used or the call fails naming it. A tied output layer is written as
    ``lm_head.weight`` too (transformers' NemotronH reads its own)."""
    take = TakenTensors(state, HFAdapterError, "state dict")
    embed = take("embed.weight")
    out = {f"{SAVED_PREFIX}embeddings.weight": embed, f"{SAVED_PREFIX}norm_f.weight": take("norm.weight"),
           "lm_head.weight": embed.clone() if cfg.tie_word_embeddings else take("output.weight")}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i, kind in enumerate(cfg.layer_kinds()):
        hf, ours = f"{SAVED_PREFIX}layers.{i}.", f"layers.{i}."
        out[hf + "norm.weight"] = take(ours + "norm.weight")
        for mine, theirs in _layer_names(cfg, kind):
            out[hf + "mixer." + theirs] = take(ours + "mixer." + mine)
        if kind == ATTENTION:
            for name, part in zip(_QKV, take(ours + "mixer.qkv.weight").split([q, kv, kv])):
                out[hf + "mixer." + name] = part.contiguous()
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"state dict has {extra[0]!r}, which {ARCHITECTURE} does not hold")
    return out
