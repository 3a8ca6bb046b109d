"""A VLM assembled from pretrained parts (``init.vision`` / ``init.audio`` / ``init.language`` /
``init.projector``): weights-only loading of the components given, with a report of what was loaded, what kept
its initialization and what the sources held that the model does not use.

A source is a Hugging Face folder (CLIP/SigLIP vision, Whisper, Llama/Qwen2/Mixtral, or a LLaVA for any of its
parts), a converted or trained VLM checkpoint holding the part, or (language) a GPT checkpoint. The source's
shape must be the run's (the fields that change what the weights compute, e.g. ``model.vision.class_token``);
which block LLaVA-style feature selection reads (``feature_layer``, ``drop_first_token``) is the run's choice.
A missing tensor of a given component, or an unused tensor of a source, is an error unless the run lists it
(``init.expect_missing`` / ``init.expect_unused``). Each rank keeps its own TP shards (placement from the
model's sharding spec); from a Hugging Face folder it reads only those (``safe_open(...).get_slice``, through
``mmtrain.convert.lazy_tensors``; a tensor the import transposes or stacks, e.g. Mixtral experts, is read whole),
from a checkpoint the part's full tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmtrain.config.vlm_schema import VLMModelConfig
from mmtrain.convert.checkpoint_io import (
    ConvertError,
    read_checkpoint_json,
    read_full_state,
    resolve_checkpoint_folder,
)
from mmtrain.convert.hf_files import read_hf_config, read_hf_tensors
from mmtrain.convert.lazy_tensors import materialize
from mmtrain.convert.vlm_convert import is_vlm_checkpoint, read_vlm_checkpoint, vlm_from_hf
from mmtrain.models.vlm import VLMModel
from mmtrain.models import encoders_hf, llava_hf
from mmtrain.models.registry import family_for_hf, hf_errors, model_family
from mmtrain.parallel.tensor import tp_shard_of

# the fields of each part that change what its weights compute (a source must agree on every one)
_VISION_FIELDS = ("image_size", "patch_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                  "norm", "norm_eps", "activation", "add_bias", "patch_bias", "class_token", "pre_norm", "post_norm",
                  "position_embedding", "rope_theta", "temporal_embedding")
_AUDIO_FIELDS = ("n_mels", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "max_frames",
                 "norm_eps", "activation", "position_embedding")
_FIELDS = {"vision": _VISION_FIELDS, "audio": _AUDIO_FIELDS}


def _part_cfg(cfg: VLMModelConfig, part: str):
    return {"vision": cfg.vision, "audio": cfg.audio, "language": cfg.language, "projector": cfg.projector}[part]


def read_part(source: str | Path, part: str) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """(the source's config of ``part``, its tensors under ``part.``-less VLM names, HF tensors left out on
    purpose) from a Hugging Face folder or an mmtrain checkpoint. An HF config that the adapters refuse (or
    that contradicts its weights) is a ``ConvertError`` naming the source."""
    try:
        return _read_part(source, part)
    except (encoders_hf.EncoderHFError, *hf_errors()) as exc:
        raise ConvertError(f"init.{part}={source}: {exc}") from None


def _read_part(source: str | Path, part: str) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    folder = Path(source)
    if (folder / "config.json").is_file():
        hf_config = read_hf_config(folder)
        kind = hf_config.get("model_type")
        if kind in (*encoders_hf.VISION_TYPES, *encoders_hf.AUDIO_TYPES, *llava_hf.LLAVA_TYPES):
            cfg, full, parts, skipped = vlm_from_hf(hf_config, read_hf_tensors(folder, lazy=True))
            if part not in parts:
                raise ConvertError(f"init.{part}={source}: a {kind} folder holds {', '.join(parts)}, not {part}")
            return _part_cfg(cfg, part), _strip_part(full, part), skipped
        if part != "language":
            raise ConvertError(f"init.{part}={source}: model_type={kind!r} has no {part} (expected a CLIP/SigLIP "
                               "vision, Whisper or LLaVA folder)")
        adapter = family_for_hf(hf_config).hf
        try:
            lm = adapter.config_from_hf(hf_config)
        except KeyError as exc:
            raise ConvertError(f"init.language={source}/config.json: no {exc.args[0]!r}") from None
        return lm, adapter.state_from_hf(read_hf_tensors(folder, lazy=True), lm), []
    meta = read_checkpoint_json(resolve_checkpoint_folder(folder))
    if is_vlm_checkpoint(meta):
        full, cfg, _, parts = read_vlm_checkpoint(folder)
        if part not in parts:
            raise ConvertError(f"init.{part}={source}: the checkpoint holds {', '.join(parts)}, not {part}")
        return _part_cfg(cfg, part), _strip_part(full, part), []
    if part != "language":
        raise ConvertError(f"init.{part}={source}: a language-model checkpoint has no {part}")
    full, lm, _ = read_full_state(folder)
    return lm, full, []


def _strip_part(full: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(part + "."): v for k, v in full.items() if k.startswith(part + ".")}


def _check_shape(part: str, source: str, ours, theirs) -> None:
    if part == "projector":
        return  # no config of its own: the tensor shapes are checked one by one
    if part == "language":  # the fields that change what the weights compute: its family says which
        run, src = ({"family": c.family, **model_family(c).architecture(c)} for c in (ours, theirs))
    else:
        run, src = ({k: getattr(c, k) for k in _FIELDS[part]} for c in (ours, theirs))
    # the layer count may differ (a tower cut after its feature layer): extra or absent blocks are then the
    # unused / missing tensors the report checks
    differ = [k for k in run if k.rsplit(".", 1)[-1] != "num_layers" and run[k] != src.get(k)]
    if differ:
        raise ConvertError(f"init.{part}={source} does not fit this run's model.{part}: "
                           + "; ".join(f"model.{part}.{k}: run {run[k]!r}, source {src.get(k)!r}" for k in differ))


def _listed(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def load_vlm_parts(model: torch.nn.Module, cfg: VLMModelConfig, sources: dict[str, str], tp_rank: int = 0,
                   tp: int = 1, expect_unused: list[str] | None = None,
                   expect_missing: list[str] | None = None) -> dict[str, Any]:
    """Copy each given part's weights into ``model`` (this rank's stage of a VLM of ``cfg``, TP plan applied:
    its shard ``tp_rank`` of ``tp``). Returns the report: per part its source, the tensors loaded, the ones
    kept at their initialization (listed in ``expect_missing``) and the source tensors left unused (listed in
    ``expect_unused``), and the components initialised (no source). Raises ``ConvertError`` on a shape that
    differs, or on an unlisted missing or unused tensor."""
    expect_unused, expect_missing = list(expect_unused or []), list(expect_missing or [])
    with torch.device("meta"):
        whole_spec = VLMModel(cfg).sharding_spec()  # every tensor of the whole model, whatever this stage holds
    spec = model.sharding_spec()
    own = dict(model.state_dict(keep_vars=True))
    report: dict[str, Any] = {"parts": {}, "initialised": [c for c in ("vision", "audio", "projector", "language")
                                                           if c not in sources and (c != "audio" or cfg.audio.enabled)]}
    for part, source in sources.items():
        part_cfg, tensors, left_out = read_part(source, part)
        _check_shape(part, source, _part_cfg(cfg, part), part_cfg)
        wanted = {whole_spec.stored_name(n) for n in whole_spec if n.startswith(part + ".")}
        missing = sorted(n for n in wanted if n.removeprefix(part + ".") not in tensors
                         and not whole_spec[n].buffer)
        bad_missing = [n for n in missing if not _listed(n, expect_missing)]
        if bad_missing:
            raise ConvertError(f"init.{part}={source} lacks {len(bad_missing)} tensor(s) of this model, e.g. "
                               f"{', '.join(bad_missing[:4])}; list what may keep its initialization in "
                               "init.expect_missing")
        unused = sorted(f"{part}.{k}" for k in tensors if f"{part}.{k}" not in wanted)
        bad_unused = [n for n in unused if not _listed(n, expect_unused)]
        if bad_unused:
            raise ConvertError(f"init.{part}={source} holds {len(bad_unused)} tensor(s) this model does not use, "
                               f"e.g. {', '.join(bad_unused[:4])}; list them in init.expect_unused if that is "
                               "intended")
        loaded = 0
        for name, t in own.items():
            if not name.startswith(part + "."):
                continue
            key = spec.stored_name(name).removeprefix(part + ".")
            if key not in tensors:
                continue
            piece = materialize(tp_shard_of(name, tensors[key], spec, tp_rank, tp))  # reads this rank's rows
            if piece.shape != t.shape:
                raise ConvertError(f"{name}: init.{part}={source} has global shape {tuple(tensors[key].shape)}, "
                                   f"this rank's shard is {tuple(t.shape)} (does model.{part} match the source?)")
            t.copy_(piece)
            loaded += 1
        report["parts"][part] = {"source": str(source), "loaded": loaded, "kept_init": missing,
                                 "unused": unused, "left_out": left_out}
    return report


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as log lines: one per part, then the components initialised."""
    lines = []
    for part, r in report["parts"].items():
        extra = "".join(f"; {what} {len(r[key])} (e.g. {r[key][0]})" for key, what in
                        (("kept_init", "kept their init"), ("unused", "unused"), ("left_out", "left out by the import"))
                        if r[key])
        lines.append(f"init.{part}: loaded {r['loaded']} tensor(s) on this rank from {r['source']}{extra}")
    if report["initialised"]:
        lines.append(f"initialised (no source): {', '.join(report['initialised'])}")
    return lines
