"""Hugging Face encoders <-> mmtrain's encoders, on full tensors: CLIP and SigLIP vision towers into the ViT
(``mmtrain.model.vision.VisionEncoder``), the Whisper encoder into the audio encoder (``mmtrain.model.audio``).

What the towers need is in the encoder configs (``VisionConfig``/``AudioConfig``): CLIP has a class token,
no patch-conv bias, a pre-norm (``pre_layrnorm``) and quick_gelu, and its ``post_layernorm`` touches only the
pooled output (so a standalone tower's features are the last block's output: ``feature_layer=-1``); SigLIP has
no class token, gelu (tanh) and a post-norm on every token (its pooling head is not imported). Separate q/k/v
projections become the fused ``qkv`` ([q | k | v] rows); Whisper's key projection has no bias, which is a zero
bias here (a key bias adds the same amount to every score of a query: softmax ignores it, so it stays zero).

Every name the tower holds is mapped or refused: an unmapped HF tensor is an error (``EncoderHFError``), except
the parts the import leaves out on purpose (``EXPECTED_UNUSED``), which are reported by the caller. Before any
tensor is mapped, the config's layer count and every shape it implies are checked against the tensors' shapes
(``mmtrain.models.hf_shapes``), naming the config key.
"""

from __future__ import annotations

from typing import Any

import torch

from mmtrain.config.vlm_schema import AudioConfig, VisionConfig
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, fixed, indices

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
AUDIO_TYPES = ("whisper",)
# name prefixes that a tower's tensors carry in the checkpoints that hold it (first match is stripped)
_VISION_PREFIXES = ("vision_model.",)
_AUDIO_PREFIXES = ("model.encoder.", "encoder.")
# what an import leaves out on purpose: SigLIP's pooling head, Whisper's decoder and output projection
EXPECTED_UNUSED = ("head.", "decoder.", "model.decoder.", "proj_out.")
_VISION_ACT = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf"}
_AUDIO_ACT = {"gelu": "gelu_erf"}


class EncoderHFError(ValueError):
    """A Hugging Face encoder config or weights that mmtrain's encoders cannot hold; the message names the key."""


def _get(hf: dict[str, Any], key: str, where: str) -> Any:
    if key not in hf:
        raise EncoderHFError(f"{where}: no {key!r} (not a complete config)")
    return hf[key]


def _get_int(hf: dict[str, Any], key: str, where: str) -> int:
    """``hf[key]``, a positive integer (``EncoderHFError`` naming the key otherwise)."""
    _get(hf, key, where)
    return config_int(hf, key, EncoderHFError)


# ------------------------------------------------------------------------------------------------ vision
def vision_config_from_hf(hf: dict[str, Any], feature_layer: int | None = None,
                          drop_first_token: bool = False) -> VisionConfig:
    """The ``VisionConfig`` of a CLIP/SigLIP vision config. ``feature_layer`` (``VisionConfig.feature_layer``)
    defaults to what the standalone tower returns as ``last_hidden_state``."""
    kind = hf.get("model_type")
    if kind not in VISION_TYPES:
        raise EncoderHFError(f"vision config model_type={kind!r}; expected one of {', '.join(VISION_TYPES)}")
    act = _get(hf, "hidden_act", kind)
    if act not in _VISION_ACT:
        raise EncoderHFError(f"{kind}: hidden_act={act!r} is not supported (supported: {', '.join(_VISION_ACT)})")
    if hf.get("num_channels", 3) != 3:
        raise EncoderHFError(f"{kind}: num_channels={hf['num_channels']}; the ViT takes RGB images (3)")
    clip = kind == "clip_vision_model"
    return VisionConfig(
        image_size=_get_int(hf, "image_size", kind), patch_size=_get_int(hf, "patch_size", kind),
        hidden_size=_get_int(hf, "hidden_size", kind), num_layers=_get_int(hf, "num_hidden_layers", kind),
        num_attention_heads=_get_int(hf, "num_attention_heads", kind),
        ffn_hidden_size=_get_int(hf, "intermediate_size", kind), norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-5 if clip else 1e-6)), activation=_VISION_ACT[act],
        add_bias=True, patch_bias=not clip, class_token=clip, pre_norm=clip, post_norm=True,
        position_embedding="learned", temporal_embedding=False,
        feature_layer=(-1 if clip else 0) if feature_layer is None else feature_layer,
        drop_first_token=drop_first_token)


def vision_config_to_hf(cfg: VisionConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A CLIP (class token) or SigLIP (none) vision config for ``cfg``; refuses what neither tower has."""
    clip = cfg.class_token
    want = {"norm": "layernorm", "position_embedding": "learned", "add_bias": True, "post_norm": True,
            "temporal_embedding": False, "pre_norm": clip, "patch_bias": not clip,
            "activation": ("quick_gelu", "gelu_erf") if clip else ("gelu", "gelu_erf")}
    for key, allowed in want.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if getattr(cfg, key) not in allowed:
            raise EncoderHFError(f"model.vision.{key}={getattr(cfg, key)!r} has no {'CLIP' if clip else 'SigLIP'} "
                                 f"equivalent (needs {' or '.join(map(repr, allowed))})")
    act = {"quick_gelu": "quick_gelu", "gelu": "gelu_pytorch_tanh", "gelu_erf": "gelu"}[cfg.activation]
    out = dict(base or {})
    out.update(model_type="clip_vision_model" if clip else "siglip_vision_model", image_size=cfg.image_size,
               patch_size=cfg.patch_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size,
               layer_norm_eps=cfg.norm_eps, hidden_act=act, num_channels=3)
    if not clip:
        out["vision_use_head"] = False
    return out


def _strip(tensors: dict[str, torch.Tensor], prefixes: tuple[str, ...],
           what: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the tower's tensors without their prefix, the names outside it); the latter must be expected-unused."""
    for p in prefixes:
        if any(k.startswith(p) for k in tensors):
            outside = sorted(k for k in tensors if not k.startswith(p))
            bad = [k for k in outside if not k.startswith(EXPECTED_UNUSED)]
            if bad:
                raise EncoderHFError(f"{what}: tensors outside {p!r} not mapped to mmtrain: {bad[:6]}")
            return {k.removeprefix(p): v for k, v in tensors.items() if k.startswith(p)}, outside
    return dict(tensors), []


class _Taker:
    """Reads HF tensors by name, remembering which were used (the rest must be expected-unused)."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        self.tensors, self.what, self.used = tensors, what, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise EncoderHFError(f"{self.what} weights lack {name} (does config.json describe these weights?)")
        self.used.add(name)
        return self.tensors[name]

    def unused(self) -> list[str]:
        return sorted(n for n in set(self.tensors) - self.used if not n.startswith(EXPECTED_UNUSED))


def _block_from_hf(take: _Taker, hf: str, ours: str, norms: tuple[str, str], mlp: str,
                   zero_k_bias: bool = False) -> dict[str, torch.Tensor]:
    att = hf + "self_attn."
    out = {}
    for mine, theirs in zip(("attn_norm", "mlp_norm"), norms):
        out[f"{ours}{mine}.weight"] = take(f"{hf}{theirs}.weight")
        out[f"{ours}{mine}.bias"] = take(f"{hf}{theirs}.bias")
    out[ours + "attn.qkv.weight"] = torch.cat([take(att + f"{p}_proj.weight") for p in "qkv"])
    q_bias, v_bias = take(att + "q_proj.bias"), take(att + "v_proj.bias")
    k_bias = torch.zeros_like(q_bias) if zero_k_bias else take(att + "k_proj.bias")
    out[ours + "attn.qkv.bias"] = torch.cat([q_bias, k_bias, v_bias])
    out[ours + "attn.proj.weight"] = take(att + "out_proj.weight")
    out[ours + "attn.proj.bias"] = take(att + "out_proj.bias")
    for mine, theirs in (("up", "fc1"), ("down", "fc2")):
        out[f"{ours}mlp.{mine}.weight"] = take(f"{hf}{mlp}{theirs}.weight")
        out[f"{ours}mlp.{mine}.bias"] = take(f"{hf}{mlp}{theirs}.bias")
    return out


def _block_to_hf(full: dict[str, torch.Tensor], ours: str, hf: str, width: int, norms: tuple[str, str], mlp: str,
                 drop_k_bias: bool = False) -> dict[str, torch.Tensor]:
    att = hf + "self_attn."
    out = {}
    for mine, theirs in zip(("attn_norm", "mlp_norm"), norms):
        out[f"{hf}{theirs}.weight"] = full[f"{ours}{mine}.weight"]
        out[f"{hf}{theirs}.bias"] = full[f"{ours}{mine}.bias"]
    for p, w, b in zip("qkv", full[ours + "attn.qkv.weight"].split(width), full[ours + "attn.qkv.bias"].split(width)):
        out[att + f"{p}_proj.weight"] = w
        if not (drop_k_bias and p == "k"):
            out[att + f"{p}_proj.bias"] = b
    out[att + "out_proj.weight"] = full[ours + "attn.proj.weight"]
    out[att + "out_proj.bias"] = full[ours + "attn.proj.bias"]
    for mine, theirs in (("up", "fc1"), ("down", "fc2")):
        out[f"{hf}{mlp}{theirs}.weight"] = full[f"{ours}mlp.{mine}.weight"]
        out[f"{hf}{mlp}{theirs}.bias"] = full[f"{ours}mlp.{mine}.bias"]
    return out


def _block_shapes(hf: str, d: Size, ffn: Size, norms: tuple[str, str], mlp: str) -> Shapes:
    """The shapes of one pre-norm block's HF tensors (``_block_from_hf``'s names)."""
    att = hf + "self_attn."
    out: Shapes = {f"{hf}{n}.{w}": (d,) for n in norms for w in ("weight", "bias")}
    for p in ("q", "k", "v", "out"):
        out.update({f"{att}{p}_proj.weight": (d, d), f"{att}{p}_proj.bias": (d,)})
    out.update({f"{hf}{mlp}fc1.weight": (ffn, d), f"{hf}{mlp}fc1.bias": (ffn,), f"{hf}{mlp}fc2.weight": (d, ffn),
                f"{hf}{mlp}fc2.bias": (d,)})
    return out


def check_vision_weights(tensors: dict[str, torch.Tensor], cfg: VisionConfig, config_prefix: str = "") -> None:
    """A tower's layer count and every shape its config implies against its tensors (names without the
    ``vision_model.`` prefix); ``EncoderHFError`` naming the config key (under ``config_prefix``)."""
    check_count("num_hidden_layers", cfg.num_layers, indices(tensors, r"encoder\.layers\.(\d+)\."),
                "layers (encoder.layers.<i>)", EncoderHFError, config_prefix)
    d, patch = Size("hidden_size", cfg.hidden_size), Size("patch_size", cfg.patch_size)
    positions = Size(f"(image_size/patch_size)^2{' + 1' if cfg.class_token else ''}", cfg.num_positions)
    out: Shapes = {"embeddings.patch_embedding.weight": (d, fixed(3), patch, patch),
                   "embeddings.patch_embedding.bias": (d,), "embeddings.position_embedding.weight": (positions, d),
                   "embeddings.class_embedding": (d,)}
    out.update({f"{n}.{w}": (d,) for n in ("pre_layrnorm", "post_layernorm") for w in ("weight", "bias")})
    for i in range(cfg.num_layers):
        out.update(_block_shapes(f"encoder.layers.{i}.", d, Size("intermediate_size", cfg.ffn_hidden_size),
                                 ("layer_norm1", "layer_norm2"), "mlp."))
    check_shapes(out, tensors, EncoderHFError, config_prefix)


def vision_state_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: VisionConfig,
                         config_prefix: str = "") -> tuple[dict, list[str]]:
    """(full ViT tensors, HF names left out on purpose) from a CLIP/SigLIP tower's tensors (with or without
    the ``vision_model.`` prefix), after ``check_vision_weights``. Raises ``EncoderHFError`` on a missing or
    unmapped tensor."""
    tensors, outside = _strip(hf_tensors, _VISION_PREFIXES, "vision tower")
    check_vision_weights(tensors, cfg, config_prefix)
    take = _Taker(tensors, "vision tower")
    out = {"patch_embed.weight": take("embeddings.patch_embedding.weight"),
           "pos_embed": take("embeddings.position_embedding.weight"),
           "norm.weight": take("post_layernorm.weight"), "norm.bias": take("post_layernorm.bias")}
    if cfg.patch_bias:
        out["patch_embed.bias"] = take("embeddings.patch_embedding.bias")
    if cfg.class_token:
        out["class_embed"] = take("embeddings.class_embedding")
    if cfg.pre_norm:
        out["pre_norm.weight"], out["pre_norm.bias"] = take("pre_layrnorm.weight"), take("pre_layrnorm.bias")
    for i in range(cfg.num_layers):
        out.update(_block_from_hf(take, f"encoder.layers.{i}.", f"layers.{i}.", ("layer_norm1", "layer_norm2"),
                                  "mlp."))
    tensors.pop("embeddings.position_ids", None)  # a derived buffer some checkpoints carry
    if take.unused():
        raise EncoderHFError(f"vision tower tensors not mapped to mmtrain's ViT: {take.unused()[:6]}")
    return out, outside + sorted(set(tensors) - take.used)


def vision_state_to_hf(full: dict[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    """The tower's HF tensors (no prefix) from full ViT tensors (the inverse of ``vision_state_from_hf``)."""
    out = {"embeddings.patch_embedding.weight": full["patch_embed.weight"],
           "embeddings.position_embedding.weight": full["pos_embed"],
           "post_layernorm.weight": full["norm.weight"], "post_layernorm.bias": full["norm.bias"]}
    if cfg.patch_bias:
        out["embeddings.patch_embedding.bias"] = full["patch_embed.bias"]
    if cfg.class_token:
        out["embeddings.class_embedding"] = full["class_embed"]
    if cfg.pre_norm:
        out["pre_layrnorm.weight"], out["pre_layrnorm.bias"] = full["pre_norm.weight"], full["pre_norm.bias"]
    for i in range(cfg.num_layers):
        out.update(_block_to_hf(full, f"layers.{i}.", f"encoder.layers.{i}.", cfg.hidden_size,
                                ("layer_norm1", "layer_norm2"), "mlp."))
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------------------------- audio
def audio_config_from_hf(hf: dict[str, Any], num_tokens: int = 8) -> AudioConfig:
    """The ``AudioConfig`` of a Whisper config's encoder (learned positions, exact GELU, LayerNorm 1e-5).
    The log-mel front end keeps Whisper's settings (16 kHz, n_fft 400, hop 160)."""
    if hf.get("model_type") not in AUDIO_TYPES:
        raise EncoderHFError(f"audio config model_type={hf.get('model_type')!r}; expected whisper")
    act = hf.get("activation_function", "gelu")
    if act not in _AUDIO_ACT:
        raise EncoderHFError(f"whisper: activation_function={act!r} is not supported (supported: gelu)")
    return AudioConfig(enabled=True, n_mels=_get_int(hf, "num_mel_bins", "whisper"),
                       hidden_size=_get_int(hf, "d_model", "whisper"),
                       num_layers=_get_int(hf, "encoder_layers", "whisper"),
                       num_attention_heads=_get_int(hf, "encoder_attention_heads", "whisper"),
                       ffn_hidden_size=_get_int(hf, "encoder_ffn_dim", "whisper"),
                       max_frames=_get_int(hf, "max_source_positions", "whisper"), num_tokens=num_tokens,
                       norm_eps=1e-5, activation="gelu_erf", position_embedding="learned")


def audio_config_to_hf(cfg: AudioConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    if cfg.activation != "gelu_erf" or cfg.position_embedding != "learned":
        raise EncoderHFError("model.audio needs activation=gelu_erf and position_embedding=learned to be a Whisper "
                             "encoder")
    out = dict(base or {})
    out.update(model_type="whisper", num_mel_bins=cfg.n_mels, d_model=cfg.hidden_size,
               encoder_layers=cfg.num_layers, encoder_attention_heads=cfg.num_attention_heads,
               encoder_ffn_dim=cfg.ffn_hidden_size, max_source_positions=cfg.max_frames,
               activation_function="gelu")
    return out


def audio_state_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: AudioConfig) -> tuple[dict, list[str]]:
    """(full audio-encoder tensors, HF names left out on purpose) from a Whisper encoder's tensors (a
    ``WhisperEncoder``, or a ``WhisperModel``/``WhisperForConditionalGeneration`` whose decoder is left out)."""
    if cfg.position_embedding != "learned":
        raise EncoderHFError("a Whisper import needs model.audio.position_embedding=learned")
    tensors, outside = _strip(hf_tensors, _AUDIO_PREFIXES, "whisper")  # outside: the decoder, left out
    check_count("encoder_layers", cfg.num_layers, indices(tensors, r"layers\.(\d+)\."), "encoder layers",
                EncoderHFError)
    d, three = Size("d_model", cfg.hidden_size), fixed(3)
    shapes: Shapes = {"conv1.weight": (d, Size("num_mel_bins", cfg.n_mels), three), "conv1.bias": (d,),
                      "conv2.weight": (d, d, three), "conv2.bias": (d,),
                      "embed_positions.weight": (Size("max_source_positions", cfg.max_frames), d),
                      "layer_norm.weight": (d,), "layer_norm.bias": (d,)}
    for i in range(cfg.num_layers):
        shapes.update(_block_shapes(f"layers.{i}.", d, Size("encoder_ffn_dim", cfg.ffn_hidden_size),
                                    ("self_attn_layer_norm", "final_layer_norm"), ""))
    check_shapes(shapes, tensors, EncoderHFError)
    take = _Taker(tensors, "whisper encoder")
    out = {f"conv{i}.{w}": take(f"conv{i}.{w}") for i in (1, 2) for w in ("weight", "bias")}
    out["pos_embed"] = take("embed_positions.weight")
    out["norm.weight"], out["norm.bias"] = take("layer_norm.weight"), take("layer_norm.bias")
    for i in range(cfg.num_layers):
        out.update(_block_from_hf(take, f"layers.{i}.", f"layers.{i}.", ("self_attn_layer_norm", "final_layer_norm"),
                                  "", zero_k_bias=True))
    if take.unused():
        raise EncoderHFError(f"whisper encoder tensors not mapped to mmtrain's audio encoder: {take.unused()[:6]}")
    return out, outside + sorted(set(tensors) - take.used)


def audio_state_to_hf(full: dict[str, torch.Tensor], cfg: AudioConfig) -> dict[str, torch.Tensor]:
    """A ``WhisperEncoder``'s tensors (no prefix) from full audio-encoder tensors."""
    out = {f"conv{i}.{w}": full[f"conv{i}.{w}"] for i in (1, 2) for w in ("weight", "bias")}
    out["embed_positions.weight"] = full["pos_embed"]
    out["layer_norm.weight"], out["layer_norm.bias"] = full["norm.weight"], full["norm.bias"]
    for i in range(cfg.num_layers):
        out.update(_block_to_hf(full, f"layers.{i}.", f"layers.{i}.", cfg.hidden_size,
                                ("self_attn_layer_norm", "final_layer_norm"), "", drop_k_bias=True))
    return {k: v.contiguous() for k, v in out.items()}
