"""The two conversions end to end: HF folder -> mmtrain checkpoint, and mmtrain checkpoint -> HF folder (VLM
towers, Whisper and LLaVA through ``mmtrain.convert.vlm_convert``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmtrain.convert.checkpoint_io import (
    ConvertError,
    checkpoint_lora,
    read_checkpoint_config,
    read_checkpoint_json,
    read_full_state,
    refuse_existing_checkpoints,
    resolve_checkpoint_folder,
    write_weights_checkpoint,
)
from mmtrain.convert.hf_files import read_hf_config, read_hf_tensors, write_hf_folder, write_peft_adapter
from mmtrain.convert.hf_tokenizer import hf_tokenizer_files, open_tokenizer, recorded_tokenizer
from mmtrain.convert.vlm_convert import is_vlm_checkpoint, is_vlm_hf, vlm_hf_to_mmtrain, vlm_mmtrain_to_hf
from mmtrain.core.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from mmtrain.models.registry import family_for_hf, model_family

LORA_EXPORTS = ("merge", "adapter")


def hf_to_mmtrain(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1,
                  pipeline_layers: list[int] | None = None) -> Path:
    """Convert a Hugging Face folder into a weights-only mmtrain checkpoint root ``out`` (new or empty: a root
    holding checkpoints is refused); returns the step folder. Tensors keep their stored dtype. Every shape the
    config implies is checked against the safetensors headers first (the adapters' ``state_from_hf``)."""
    refuse_existing_checkpoints(out)
    hf_config = read_hf_config(hf_dir)
    if is_vlm_hf(hf_config):  # a CLIP/SigLIP tower, a Whisper model or a LLaVA
        return vlm_hf_to_mmtrain(hf_dir, out, tp, pp, pipeline_layers)[0]
    hf_tensors = read_hf_tensors(hf_dir)  # every file read (and checked) before its values are interpreted
    adapter = family_for_hf(hf_config).hf  # by model_type
    try:
        cfg = adapter.config_from_hf(hf_config)
    except KeyError as exc:
        raise adapter.errors()[0](f"{Path(hf_dir) / 'config.json'}: no {exc.args[0]!r} (not a complete "
                                  f"{'/'.join(adapter.model_types)} config)") from None
    full = adapter.state_from_hf(hf_tensors, cfg)
    extra = {"hf_config": hf_config, "converted_from": str(hf_dir)}
    tok = _hf_folder_tokenizer(Path(hf_dir))
    if tok is not None:  # what evaluate / generate / lm_eval check a tokenizer or data against
        extra["tokenizer"] = tok.describe()
    return write_weights_checkpoint(out, full, cfg, tp, pp, pipeline_layers, extra_meta=extra)


def _hf_folder_tokenizer(hf_dir: Path) -> Tokenizer | None:
    """The HF folder's own tokenizer (its tokenizer.json), or None when it has none that loads: the weights
    convert without it, and the checkpoint then names no tokenizer (``--tokenizer`` is needed downstream)."""
    if not (hf_dir / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(hf_dir.resolve())
    except TokenizerError:
        return None


def mmtrain_to_hf(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None, lora: str = "merge",
                  tokenizer: str | Path | None = None, with_tokenizer: bool = True) -> Path:
    """Convert an mmtrain checkpoint (a step folder or a checkpoints root with ``latest``; weights-only or from
    training, any TP/PP) into a Hugging Face folder ``out``. ``dtype`` casts floating tensors when given.
    A LoRA run's checkpoint: ``lora="merge"`` writes the merged model, ``"adapter"`` only the adapters as a
    ``peft`` folder (adapter_config.json + adapter_model.safetensors) for the HF export of the base. A VLM
    checkpoint is written as ``LlavaForConditionalGeneration`` (or its single tower). The tokenizer files and
    ``generation_config.json`` come from ``tokenizer`` (a path), else from the tokenizer the checkpoint names
    (``mmtrain.convert.hf_tokenizer``); ``with_tokenizer=False``: weights and config only."""
    if lora not in LORA_EXPORTS:
        raise ConvertError(f"--lora {lora}: choose {' or '.join(LORA_EXPORTS)}")
    if is_vlm_checkpoint(read_checkpoint_json(resolve_checkpoint_folder(ckpt))):
        return vlm_mmtrain_to_hf(ckpt, out, dtype)
    tok, extra = None, {}
    if with_tokenizer and lora != "adapter":  # checked before the tensors are read: a bad tokenizer fails fast
        tok, extra = export_tokenizer(ckpt, tokenizer)
    full, cfg, meta = read_full_state(ckpt)
    adapter = model_family(cfg).hf
    lora_cfg = checkpoint_lora(meta, ckpt)
    if lora_cfg is not None and adapter.merge_lora is None:
        raise ConvertError(f"{ckpt}: LoRA adapters of model.family={cfg.family} cannot be exported")
    if lora_cfg is None and lora == "adapter":
        raise ConvertError(f"{ckpt}: --lora adapter, but the checkpoint's run had no LoRA (peft.lora.rank=0)")
    if lora_cfg is not None and lora == "adapter":
        config, tensors = adapter.lora_to_peft(full, cfg, lora_cfg, str(meta.get("converted_from") or ""))
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        return write_peft_adapter(out, config, tensors)
    if lora_cfg is not None:
        full = adapter.merge_lora(full, cfg, lora_cfg)
    tensors = adapter.state_to_hf(full, cfg)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    hf_config = export_config(cfg, meta, next(iter(tensors.values())).dtype, tok)
    return write_hf_folder(out, hf_config, tensors, extra_files=extra)


def export_tokenizer(ckpt: str | Path, tokenizer: str | Path | None) -> tuple[Tokenizer | None, dict[str, bytes]]:
    """(the tokenizer an HF export of ``ckpt`` carries, its files: tokenizer.json, tokenizer_config.json, ...,
    generation_config.json): ``tokenizer`` (a path) if given, else the one the checkpoint names; (None, {}) when
    it names none."""
    tok = open_tokenizer(tokenizer) if tokenizer is not None else recorded_tokenizer(read_checkpoint_config(ckpt)[1])
    if tok is None:
        return None, {}
    files, generation = hf_tokenizer_files(tok)
    return tok, {**files, "generation_config.json": (json.dumps(generation, indent=2, sort_keys=True) + "\n").encode()}


def export_config(cfg, meta: dict, dtype: torch.dtype, tok: Tokenizer | None) -> dict:
    """config.json of the HF export of a checkpoint of ``cfg`` (``meta``: its complete.json) whose weights are
    ``dtype``; a tokenizer with ids past the model's vocabulary is refused."""
    hf_config = model_family(cfg).hf.config_to_hf(cfg, meta.get("hf_config"))
    # "torch_dtype" for transformers 4, "dtype" for transformers 5
    hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
    if tok is not None and tok.max_id >= cfg.shape().vocab_size:
        raise ConvertError(f"tokenizer {tok.path} has ids up to {tok.max_id} but the model's vocabulary is "
                           f"{cfg.shape().vocab_size}; pass the tokenizer the model was trained with")
    return hf_config
