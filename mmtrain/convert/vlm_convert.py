"""The VLM half of the Hugging Face bridge: CLIP/SigLIP vision towers, Whisper encoders and whole LLaVA models
into mmtrain weights-only checkpoints (any TP/PP layout), and VLM checkpoints back out as LLaVA (or a tower).

A converted checkpoint stores the same global names a ``pretrain_vlm`` run saves (``vision.*``, ``audio.*``,
``projector.*``, ``language.*``); a tower alone holds only its component. ``complete.json`` records the VLM
model config (``config.model``) and ``vlm_parts``: the components it holds, which ``init.vision`` /
``init.audio`` / ``init.language`` of a run read. Placement comes from the modules' sharding specs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mmtrain.config.loader import apply_mapping
from mmtrain.config.vlm_schema import VLMModelConfig
from mmtrain.convert.checkpoint_io import (
    ConvertError,
    layout_chunks,
    read_checkpoint_json,
    read_model_tensors,
    refuse_existing_checkpoints,
    resolve_checkpoint_folder,
    write_chunks_checkpoint,
)
from mmtrain.convert.hf_files import read_hf_config, read_hf_tensors, write_hf_folder
from mmtrain.model.vision import VisionEncoder
from mmtrain.models.vlm import COMPONENTS, VLMModel
from mmtrain.models import encoders_hf, llava_hf
from mmtrain.parallel.pipeline import stage_layer_ranges

VLM_HF_TYPES = (*encoders_hf.VISION_TYPES, *encoders_hf.AUDIO_TYPES, *llava_hf.LLAVA_TYPES)


def is_vlm_hf(hf_config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is one this module converts (a tower, a Whisper model or a LLaVA)."""
    return isinstance(hf_config, dict) and hf_config.get("model_type") in VLM_HF_TYPES


def is_vlm_checkpoint(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's complete.json records a VLM model config (a converted part or a VLM run)."""
    model = (meta.get("config") or {}).get("model") if isinstance(meta, dict) else None
    return isinstance(model, dict) and "vision" in model


def vlm_from_hf(hf_config: dict[str, Any], hf_tensors: dict[str, torch.Tensor]):
    """(VLMModelConfig, full tensors under VLM names, the parts held, HF names left out on purpose)."""
    kind = hf_config["model_type"]
    cfg = VLMModelConfig()
    if kind in llava_hf.LLAVA_TYPES:
        cfg = llava_hf.vlm_config_from_llava(hf_config)
        full, skipped = llava_hf.vlm_state_from_llava(hf_tensors, cfg)
        return cfg, full, ["vision", "projector", "language"], skipped
    if kind in encoders_hf.VISION_TYPES:
        cfg.vision = encoders_hf.vision_config_from_hf(hf_config)
        part, (state, skipped) = "vision", encoders_hf.vision_state_from_hf(hf_tensors, cfg.vision)
    else:
        cfg.audio = encoders_hf.audio_config_from_hf(hf_config)
        part, (state, skipped) = "audio", encoders_hf.audio_state_from_hf(hf_tensors, cfg.audio)
    return cfg, {f"{part}.{k}": v for k, v in state.items()}, [part], skipped


def part_module(cfg: VLMModelConfig, part: str) -> torch.nn.Module:
    """The encoder module of ``part`` alone (meta device when called under it)."""
    if part == "vision":
        return VisionEncoder(cfg.vision)
    from mmtrain.model.audio import AudioEncoder  # imports torchaudio

    return AudioEncoder(cfg.audio)


def _stages_and_spec(cfg: VLMModelConfig, parts: list[str], pp: int, pipeline_layers: list[int] | None):
    """Each pipeline stage's state dict (meta tensors) and the spec, for the components ``parts``."""
    with torch.device("meta"):
        if "language" in parts:
            ranges = stage_layer_ranges(cfg.language.num_layers, pp, pipeline_layers)
            stages = [VLMModel(cfg, ranges[s], s == 0, s == pp - 1) for s in range(pp)]
            spec = VLMModel(cfg).sharding_spec()
            return [m.state_dict() for m in stages], spec
        # a tower alone lives on the first stage whatever the layout
        modules = {p: part_module(cfg, p) for p in parts}
        state = {f"{p}.{k}": v for p, m in modules.items() for k, v in m.state_dict().items()}
        from mmtrain.models.spec import merge_specs

        spec = merge_specs(*(m.sharding_spec().prefixed(f"{p}.") for p, m in modules.items()), family="vlm")
        return [state], spec


def vlm_hf_to_mmtrain(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1,
                      pipeline_layers: list[int] | None = None) -> tuple[Path, list[str], list[str]]:
    """Convert a tower / Whisper / LLaVA folder into a weights-only checkpoint root ``out``: (step folder, parts
    held, HF tensors left out on purpose). ``out`` must not hold checkpoints already."""
    refuse_existing_checkpoints(out)
    hf_config = read_hf_config(hf_dir)
    hf_tensors = read_hf_tensors(hf_dir)
    cfg, full, parts, skipped = vlm_from_hf(hf_config, hf_tensors)
    if "language" not in parts and pp > 1:
        pp = 1  # an encoder alone is on the first stage: any pipeline layout reads it
    stages, spec = _stages_and_spec(cfg, parts, pp, pipeline_layers)
    model_dict = dataclasses.asdict(cfg)
    run_config = {"model": model_dict, "parallel": {"tp": tp, "pp": pp, "pipeline_layers": list(pipeline_layers or [])}}
    model_yaml = {"model": model_dict if "language" in parts else {p: model_dict[p] for p in parts}}
    folder = write_chunks_checkpoint(out, layout_chunks(full, stages, spec, tp), tp, pp, run_config, model_yaml,
                                     extra_meta={"hf_config": hf_config, "converted_from": str(hf_dir),
                                                 "vlm_parts": parts, "hf_left_out": skipped})
    return folder, parts, skipped


def read_vlm_checkpoint(path: str | Path, verify: bool = True):
    """(full tensors, VLMModelConfig, complete.json, parts held) of a VLM checkpoint (converted or trained)."""
    folder = resolve_checkpoint_folder(path)
    meta = read_checkpoint_json(folder)
    if not is_vlm_checkpoint(meta):
        raise ConvertError(f"{folder}: not a VLM checkpoint (complete.json records no model.vision)")
    cfg = VLMModelConfig()
    apply_mapping(cfg, meta["config"]["model"], f"{folder}/complete.json model config")
    full = read_model_tensors(folder, verify)
    parts = meta.get("vlm_parts") or sorted({n.split(".", 1)[0] for n in full} & set(COMPONENTS))
    return full, cfg, meta, parts


def vlm_mmtrain_to_hf(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A VLM checkpoint as a Hugging Face folder: a whole VLM as ``LlavaForConditionalGeneration``, a converted
    tower as its CLIP/SigLIP vision model or Whisper encoder."""
    full, cfg, meta, parts = read_vlm_checkpoint(ckpt)
    base = meta.get("hf_config") if isinstance(meta.get("hf_config"), dict) else None
    if "language" in parts:
        tensors = llava_hf.llava_state_from_vlm(full, cfg)
        hf_config = llava_hf.llava_config_from_vlm(cfg, base if (base or {}).get("model_type") == "llava" else None)
    elif parts == ["vision"]:
        tensors = encoders_hf.vision_state_to_hf({k.removeprefix("vision."): v for k, v in full.items()}, cfg.vision)
        hf_config = encoders_hf.vision_config_to_hf(cfg.vision, base)
        hf_config["architectures"] = ["CLIPVisionModel" if cfg.vision.class_token else "SiglipVisionModel"]
    elif parts == ["audio"]:
        tensors = encoders_hf.audio_state_to_hf({k.removeprefix("audio."): v for k, v in full.items()}, cfg.audio)
        hf_config = encoders_hf.audio_config_to_hf(cfg.audio, base)
        hf_config["architectures"] = ["WhisperEncoder"]
    else:
        raise ConvertError(f"{ckpt}: holds {parts}; only a whole VLM (-> LLaVA) or one tower converts to HF")
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    some = next(iter(tensors.values()))
    hf_config["torch_dtype"] = hf_config["dtype"] = str(some.dtype).removeprefix("torch.")
    folder = write_hf_folder(out, hf_config, tensors)
    if "vision" in parts:
        _write_processor_files(folder, cfg, meta, llava="language" in parts)
    return folder


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _write_processor_files(folder: Path, cfg: VLMModelConfig, meta: dict[str, Any], llava: bool) -> None:
    """``preprocessor_config.json`` (the run's image size and normalization: ``media.image_mean/std``), and for
    a LLaVA ``processor_config.json`` plus the run's tokenizer files when ``media.tokenizer`` is a Hugging Face
    tokenizer folder, so ``AutoProcessor`` loads the export."""
    import json

    from mmtrain.utils.atomic import atomic_write_bytes, atomic_write_text

    media = (meta.get("config") or {}).get("media") or {}
    size = cfg.vision.image_size
    clip = cfg.vision.class_token
    image = {"image_processor_type": "CLIPImageProcessor" if clip else "SiglipImageProcessor",
             "do_resize": True, "size": {"height": size, "width": size} if not clip else {"shortest_edge": size},
             "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": media.get("image_mean", [0.5, 0.5, 0.5]), "image_std": media.get("image_std", [0.5] * 3),
             "do_convert_rgb": True}
    if clip:
        image.update(do_center_crop=True, crop_size={"height": size, "width": size})
    atomic_write_text(folder / "preprocessor_config.json", json.dumps(image, indent=2) + "\n")
    if not llava:
        return
    processor = {"processor_class": "LlavaProcessor", "patch_size": cfg.vision.patch_size,
                 "vision_feature_select_strategy": "default" if cfg.vision.drop_first_token else "full",
                 "num_additional_image_tokens": int(cfg.vision.class_token), "image_token": "<image>"}
    atomic_write_text(folder / "processor_config.json", json.dumps(processor, indent=2) + "\n")
    tokenizer = Path(str(media.get("tokenizer") or ""))
    if media.get("tokenizer") and tokenizer.is_dir():
        for name in _TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                atomic_write_bytes(folder / name, (tokenizer / name).read_bytes())
