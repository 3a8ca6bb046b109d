"""Hugging Face ``LlavaForConditionalGeneration`` <-> mmtrain's VLM (``mmtrain.models.vlm.VLMModel``), on full
tensors: a CLIP or SigLIP tower (``mmtrain.models.encoders_hf``), the 2-layer GELU ``multi_modal_projector``
(= ``projector.image``: no input norm, no pixel shuffle) and a Llama or Qwen2 text model (the Llama family's
adapter, ``mmtrain.models.llama.hf_adapter``).

LLaVA takes the tower's ``hidden_states[vision_feature_layer]`` (``VisionConfig.feature_layer``: never the
post-norm) and, with ``vision_feature_select_strategy=default``, drops its first token (``drop_first_token``);
the projected features replace the ``image_token_index`` placeholders, as ``VLMModel.splice`` does.

Both layouts of the tensor names are read: the one ``state_dict()`` gives (``model.vision_tower.*``,
``model.language_model.*``, ``lm_head.weight``) and the one checkpoints are saved in (``vision_tower.*``,
``language_model.model.*``, ``language_model.lm_head.weight``); the latter is written.
"""

from __future__ import annotations

from typing import Any

import torch

from mmtrain.config.vlm_schema import ProjectorConfig, VLMModelConfig
from mmtrain.models import encoders_hf
from mmtrain.models.encoders_hf import EncoderHFError
from mmtrain.models.hf_shapes import Size, check_shapes
from mmtrain.models.llama import hf_adapter as llama_hf

LLAVA_TYPES = ("llava",)
_PARTS = {  # HF name prefix -> (part, prefix to put back for the part's adapter)
    "model.vision_tower.": ("vision", ""), "vision_tower.": ("vision", ""),
    "model.multi_modal_projector.": ("projector", ""), "multi_modal_projector.": ("projector", ""),
    "model.language_model.": ("language", "model."), "language_model.model.": ("language", "model."),
    "language_model.lm_head.": ("language", "lm_head."), "lm_head.": ("language", "lm_head."),
}


def _feature_layer(hf: dict[str, Any], num_layers: int) -> int:
    """LLaVA's ``vision_feature_layer`` (an index into ``hidden_states``, which has num_layers + 1 entries) as
    ``VisionConfig.feature_layer`` (-k: the k-th last block's output)."""
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise EncoderHFError(f"llava: vision_feature_layer={layer!r}; only one layer (an int) is supported")
    k = layer if layer < 0 else layer - (num_layers + 1)
    if not -num_layers <= k <= -1:
        raise EncoderHFError(f"llava: vision_feature_layer={layer} selects no block output of a {num_layers}-layer "
                             "tower (the embeddings alone are not supported)")
    return k


def vlm_config_from_llava(hf: dict[str, Any]) -> VLMModelConfig:
    """The ``VLMModelConfig`` of a LLaVA ``config.json``."""
    for key in ("vision_config", "text_config", "image_token_index"):
        if key not in hf:
            raise EncoderHFError(f"llava: no {key!r} (not a complete LlavaForConditionalGeneration config)")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise EncoderHFError(f"llava: projector_hidden_act={hf['projector_hidden_act']!r}; only gelu is supported")
    if not hf.get("multimodal_projector_bias", True):
        raise EncoderHFError("llava: multimodal_projector_bias=false is not supported (the projector has biases)")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise EncoderHFError(f"llava: vision_feature_select_strategy={strategy!r}; expected default or full")
    vision_hf = hf["vision_config"]
    vision = encoders_hf.vision_config_from_hf(
        vision_hf, feature_layer=_feature_layer(hf, vision_hf.get("num_hidden_layers", 0)),
        drop_first_token=strategy == "default")
    try:
        language = llama_hf.model_config_from_hf(hf["text_config"])
    except KeyError as exc:
        raise EncoderHFError(f"llava: text_config has no {exc.args[0]!r}") from None
    language.name = hf["text_config"].get("model_type", "llama")
    return VLMModelConfig(name="llava", vision=vision, language=language,
                          projector=ProjectorConfig(num_layers=2, hidden_size=language.hidden_size, pixel_shuffle=1,
                                                    input_norm=False),
                          image_token_id=int(hf["image_token_index"]))


def llava_config_from_vlm(cfg: VLMModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A LLaVA ``config.json`` for ``cfg``; refuses a VLM that LLaVA cannot express (audio, pixel shuffle,
    projector other than 2-layer GELU MLP into the LM width without input norm, a post-norm feature)."""
    pr, v = cfg.projector, cfg.vision
    if cfg.audio.enabled:
        raise EncoderHFError("model.audio.enabled: LLaVA has no audio encoder; export the VLM without it")
    if pr.pixel_shuffle != 1 or pr.input_norm or pr.num_layers != 2 or (
            pr.hidden_size not in (0, cfg.language.hidden_size)):
        raise EncoderHFError("model.projector: LLaVA's projector is a 2-layer GELU MLP into the LM width with no "
                             "input norm or pixel shuffle (num_layers=2, hidden_size=0, pixel_shuffle=1, "
                             "input_norm=false)")
    if v.feature_layer == 0:
        raise EncoderHFError("model.vision.feature_layer=0 (the post-norm output) has no LLaVA equivalent; LLaVA "
                             "takes a block's output (-1, -2, ...)")
    base = dict(base or {})
    out = {k: val for k, val in base.items() if k not in ("vision_config", "text_config")}
    out.update(model_type="llava", architectures=["LlavaForConditionalGeneration"],
               image_token_index=cfg.image_token_id, image_seq_length=cfg.tokens_per_image,
               projector_hidden_act="gelu", multimodal_projector_bias=True,
               vision_feature_layer=v.feature_layer,
               vision_feature_select_strategy="default" if v.drop_first_token else "full",
               tie_word_embeddings=cfg.language.tie_embeddings,
               vision_config=encoders_hf.vision_config_to_hf(v, base.get("vision_config")),
               text_config=llama_hf.hf_config_from_model_config(cfg.language, base.get("text_config")))
    return out


def split_llava_tensors(hf_tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{"vision"|"projector"|"language": that part's HF tensors, under the names its own adapter reads}."""
    parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}, "language": {}}
    for name, t in hf_tensors.items():
        prefix = next((p for p in _PARTS if name.startswith(p)), None)
        if prefix is None:
            raise EncoderHFError(f"llava: tensor {name} belongs to no part (vision_tower, multi_modal_projector, "
                                 "language_model)")
        part, put_back = _PARTS[prefix]
        parts[part][put_back + name.removeprefix(prefix)] = t
    return parts


def vlm_state_from_llava(hf_tensors: dict[str, torch.Tensor], cfg: VLMModelConfig) -> tuple[dict, list[str]]:
    """(full VLM tensors, HF names left out on purpose: a SigLIP pooling head) from LLaVA tensors."""
    parts = split_llava_tensors(hf_tensors)
    vision, skipped = encoders_hf.vision_state_from_hf(parts["vision"], cfg.vision, "vision_config.")
    proj = dict(parts["projector"])
    text, seen = Size("text_config.hidden_size", cfg.language.hidden_size), Size("vision_config.hidden_size",
                                                                                 cfg.vision.hidden_size)
    mm = "multi_modal_projector."
    check_shapes({mm + "linear_1.weight": (text, seen), mm + "linear_1.bias": (text,),
                  mm + "linear_2.weight": (text, text), mm + "linear_2.bias": (text,)},
                 {mm + k: v for k, v in proj.items()}, EncoderHFError)
    out = {f"vision.{k}": v for k, v in vision.items()}
    for i in (1, 2):
        for w in ("weight", "bias"):
            name = f"linear_{i}.{w}"
            if name not in proj:
                raise EncoderHFError(f"llava weights lack multi_modal_projector.{name}")
            out[f"projector.image.fc.{i - 1}.{w}"] = proj.pop(name)
    if proj:
        raise EncoderHFError(f"llava: projector tensors not mapped to mmtrain: {sorted(proj)[:6]}")
    try:
        language = llama_hf.mmtrain_state_from_hf(parts["language"], cfg.language, "text_config.")
    except (KeyError, ValueError) as exc:
        raise EncoderHFError(f"llava language model: {exc}") from None
    out.update({f"language.{k}": v for k, v in language.items()})
    return out, [f"vision_tower.{n}" for n in skipped]


def llava_state_from_vlm(full: dict[str, torch.Tensor], cfg: VLMModelConfig) -> dict[str, torch.Tensor]:
    """LLaVA tensors (the saved-checkpoint names) from full VLM tensors."""
    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}

    out = {f"vision_tower.{k}": v for k, v in encoders_hf.vision_state_to_hf(part("vision."), cfg.vision).items()}
    for i in (1, 2):
        for w in ("weight", "bias"):
            out[f"multi_modal_projector.linear_{i}.{w}"] = full[f"projector.image.fc.{i - 1}.{w}"].contiguous()
    for k, v in llama_hf.hf_state_from_mmtrain(part("language."), cfg.language).items():
        out["language_model." + k] = v  # model.* -> language_model.model.*, lm_head -> language_model.lm_head
    return out
