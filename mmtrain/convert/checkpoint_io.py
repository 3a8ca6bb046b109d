"""Full model tensors <-> mmtrain checkpoints (``torch.distributed.checkpoint`` folders of global tensors).

A checkpoint stores each weight as ``model.<global name>`` with its global shape (``mmtrain.train.checkpoint_state``),
so reading full tensors is one DCP load of whole tensors, whatever layout wrote it. Writing lays the tensors
out as the ranks of a TP x PP run would (the same boxes, from ``_stage_state`` built on the meta
device and ``mmtrain.parallel.global_chunks``): a checkpoint written here is what such a run would have saved,
minus optimizer, loader and RNG state. Such a *weights-only* checkpoint says so with ``"weights_only": true``
in ``complete.json``; ``load_model_weights`` starts a run from it (or from any training checkpoint) at any
layout. ``split_full_state``/``merge_shards`` cut and join per-rank state dicts (tests and tools). Every read
goes through the checks a resume makes: ``complete.json``'s seal, ``checksums.json`` where the checkpoint was
written with one, each file's checksum, the metadata's sizes against the files.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

import mmtrain
from mmtrain.config.family_sections import composed_families
from mmtrain.config.loader import apply_mapping
from mmtrain.config.schema import GPTRunConfig, LoraConfig, ModelConfig, ParallelConfig
from mmtrain.model.lora import reset_dora_magnitudes
from mmtrain.models.families import INLINE_FAMILY
from mmtrain.models.registry import model_family
from mmtrain.models.spec import ShardingSpec
from mmtrain.parallel.global_chunks import (
    Shard,
    chunks_from_global,
    global_shape,
    model_load_chunks,
    shard_of,
    stored_name,
)
from mmtrain.parallel.pipeline import stage_layer_ranges
from mmtrain.parallel.tensor import tp_partition, tp_shard_of
from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.dcp_io import Chunk, load_chunks, save_chunks, saved_tensors
from mmtrain.utils.checkpoint_marker import COMPLETE_NAME, checksums_for, read_marker, write_marker
from mmtrain.utils.dcp_storage import CheckpointFormatError, DamagedFileError



def _architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The model config fields that change what the weights compute (the family's; a run loading weights
    must agree on all of them)."""
    return {"family": cfg.family, **model_family(cfg).architecture(cfg)}


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message says why."""


# --------------------------------------------------------------------------------------------- layout
def _layout_dict(tp: int, pp: int) -> dict[str, int]:
    """The ``layout`` record of a checkpoint written by the converter (one replica: no DP/CP/EP)."""
    return {"world_size": tp * pp, "tp": tp, "pp": pp, "cp": 1, "dp": 1, "ep": 1}


def _rank_of(tp_rank: int, pp_rank: int, tp: int, cp: int = 1, dp: int = 1) -> int:
    """Global rank of (tp, cp=0, dp=0, pp) — the numbering of ``ParallelDims.rank``."""
    return tp_rank + tp * cp * dp * pp_rank


def _stage_state(cfg: ModelConfig, pp: int, stage: int,
                 pipeline_layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The state dict (meta tensors: no memory, exact names and shapes) of pipeline stage ``stage``."""
    ranges = stage_layer_ranges(cfg.shape().num_layers, pp, pipeline_layers)
    with torch.device("meta"):
        model = model_family(cfg).build_stage(cfg, ranges[stage], stage == 0, stage == pp - 1)
    return model.state_dict()


def _full_tensor_for(name: str, full: dict[str, torch.Tensor], spec: ShardingSpec,
                     like: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor of ``name``: a tied copy is the tensor it copies; a buffer the weights lack (a sigmoid
    router's balancing state: HF models have none) starts at zero (``like``: its meta tensor, for the shape)."""
    name = spec.stored_name(name)
    if spec[name].buffer and name not in full and like is not None:
        return torch.zeros(like.shape, dtype=like.dtype)
    if name not in full:
        raise ConvertError(f"parameter {name} is missing from the converted weights")
    return full[name]


RankStates = Iterator[tuple[tuple[int, int], dict[str, torch.Tensor]]]


def _iter_rank_states(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, pp: int,
                     pipeline_layers: list[int] | None = None) -> RankStates:
    """((tp_rank, pp_rank), that rank's model state dict) for a TP x PP layout, one rank at a time (so writing
    a large model holds one rank's shards besides the full tensors)."""
    spec = model_family(cfg).sharding_spec(cfg)
    for stage in range(pp):
        state = _stage_state(cfg, pp, stage, pipeline_layers)
        for r in range(tp):
            yield (r, stage), {name: tp_shard_of(name, _full_tensor_for(name, full, spec, t), spec, r, tp)
                               for name, t in state.items()}


def split_full_state(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, pp: int,
                     pipeline_layers: list[int] | None = None) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """{(tp_rank, pp_rank): that rank's model state dict} for a TP x PP layout."""
    return dict(_iter_rank_states(full, cfg, tp, pp, pipeline_layers))


def _merge_tp_shards(name: str, pieces: list[torch.Tensor], spec: ShardingSpec) -> torch.Tensor:
    """The full tensor of ``name`` from its TP shards in rank order (the inverse of ``tp_shard_of``)."""
    split = tp_partition(name, spec)
    if split is None or len(pieces) == 1:
        return pieces[0]
    dim, parts = split
    n = len(pieces)
    if parts is None:
        return torch.cat(pieces, dim=dim)
    # each shard is [part0/n | part1/n | ...]: regroup the slices part by part
    local_sizes = [p // n for p in parts]
    split = [piece.split(local_sizes, dim=dim) for piece in pieces]
    return torch.cat([torch.cat([split[r][i] for r in range(n)], dim=dim) for i in range(len(parts))], dim=dim)


def merge_shards(shards: dict[tuple[int, int], dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors from {(tp_rank, pp_rank): state dict}. A tied model's last-stage output copy is dropped."""
    tp = 1 + max(r for r, _ in shards)
    pp = 1 + max(s for _, s in shards)
    spec = model_family(cfg).sharding_spec(cfg)
    full: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        for name in shards[(0, stage)]:
            if spec.stored_name(name) != name:
                continue
            full[name] = _merge_tp_shards(name, [shards[(r, stage)][name] for r in range(tp)], spec)
    return full


# ----------------------------------------------------------------------------------------------- write
def _run_config_dict(cfg: ModelConfig, tp: int, pp: int, pipeline_layers: list[int] | None) -> dict[str, Any]:
    run = GPTRunConfig(model=cfg, parallel=ParallelConfig(tp=tp, pp=pp, pipeline_layers=list(pipeline_layers or [])))
    return dataclasses.asdict(run)


def _layout_chunks(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, pp: int,
                  pipeline_layers: list[int] | None = None) -> list[Chunk]:
    """The chunks (views of ``full``) that the ranks of a TP x PP run hold, as a training checkpoint stores them
    (replicated values once)."""
    stages = [_stage_state(cfg, pp, stage, pipeline_layers) for stage in range(pp)]
    return layout_chunks(full, stages, model_family(cfg).sharding_spec(cfg), tp)


def layout_chunks(full: dict[str, torch.Tensor], stage_states: list[dict[str, torch.Tensor]], spec: ShardingSpec,
                  tp: int) -> list[Chunk]:
    """The chunks (views of ``full``) that the TP ranks of each pipeline stage hold (``stage_states``: each
    stage's state dict, meta tensors: names and shapes), replicated values once."""
    chunks: dict[tuple, Chunk] = {}
    for state in stage_states:
        for name, t in state.items():
            if stored_name(name, spec) != name:
                continue  # a tied copy (the last stage's tied embedding): stored once, as the tensor it copies
            for r in range(tp):
                for c in chunks_from_global(f"model.{name}", name, _full_tensor_for(name, full, spec, t), spec,
                                            Shard(tp_rank=r, tp=tp)):
                    chunks.setdefault((c.key, c.offsets), c)
    return list(chunks.values())


def write_weights_checkpoint(root: str | Path, full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int = 1,
                             pp: int = 1, pipeline_layers: list[int] | None = None, step: int = 0,
                             extra_meta: dict[str, Any] | None = None) -> Path:
    """Write ``root/step_XXXXXXXX/`` (DCP files + ``complete.json``) + ``root/latest`` + ``root/model.yaml`` (the
    model section to include in a run config). This process alone writes (no process group). Returns the step
    folder."""
    return write_chunks_checkpoint(root, _layout_chunks(full, cfg, tp, pp, pipeline_layers), tp, pp,
                                   _run_config_dict(cfg, tp, pp, pipeline_layers), {"model": model_section(cfg)},
                                   step, extra_meta)


def model_section(cfg: ModelConfig) -> dict[str, Any]:
    """The ``model:`` section a run includes for ``cfg``: the chosen family's shape only. The other families'
    ``model.<family>`` blocks are left out (unused, they would read as part of the model); a family with its own
    block keeps ``family``, ``name`` and that block (the inline family's fields must keep their defaults then)."""
    full = dataclasses.asdict(cfg)
    for other in composed_families():
        if other != cfg.family:
            full.pop(other)
    if cfg.family == INLINE_FAMILY:
        return full
    defaults = dataclasses.asdict(ModelConfig())
    return {k: v for k, v in full.items() if k in ("family", "name", cfg.family) or v != defaults[k]}


def write_chunks_checkpoint(root: str | Path, chunks: list[Chunk], tp: int, pp: int, run_config: dict[str, Any],
                            model_yaml: dict[str, Any], step: int = 0,
                            extra_meta: dict[str, Any] | None = None) -> Path:
    """A weights-only checkpoint of ``chunks`` (``layout_chunks``) with ``run_config`` in its complete.json and
    ``model_yaml`` in ``root/model.yaml``; ``latest`` last. Returns the step folder."""
    root = Path(root)
    folder = root / f"step_{step:08d}"
    save_chunks(folder, chunks, no_dist=True)
    meta = {"step": step, "layout": _layout_dict(tp, pp), "weights_only": True, "format": "torch.distributed.checkpoint",
            "mmtrain_version": mmtrain.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": run_config, **(extra_meta or {})}
    write_marker(folder, meta)
    atomic_write_text(root / "model.yaml", "# Model shape of the converted checkpoint; include it in a run config.\n"
                      + yaml.safe_dump(model_yaml, sort_keys=False))
    atomic_write_text(root / "latest", folder.name + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ read
def resolve_checkpoint_folder(path: str | Path) -> Path:
    """A step folder itself, or a checkpoints root through its ``latest`` file."""
    path = Path(path)
    if (path / "complete.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip() / "complete.json").is_file():
        return path / latest.read_text().strip()
    raise ConvertError(f"{path}: not a complete mmtrain checkpoint (no complete.json, no latest naming one)")


def refuse_existing_checkpoints(out: str | Path) -> None:
    """A conversion writes a new checkpoints root: ``out`` must not hold checkpoints (or a model.yaml) already,
    whose ``latest`` it would move to its weights-only step 0 (``ConvertError`` naming what is there)."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConvertError(f"--out {out}: exists and is not a folder")
    found = sorted(p.name for p in out.iterdir() if p.name in ("latest", COMPLETE_NAME, "model.yaml")
                   or p.name.startswith("step_"))
    if found:
        raise ConvertError(f"--out {out}: already holds checkpoints ({', '.join(found[:3])}"
                           f"{' ...' if len(found) > 3 else ''}); a conversion writes a new checkpoints root and "
                           "would move its latest: choose a new or empty folder")


def read_checkpoint_json(folder: Path, option: str = "--ckpt") -> dict[str, Any]:
    """complete.json of a checkpoint step folder, its seal checked (a ``ConvertError`` naming the file when it
    is damaged or changed, and the checkpoint to use instead, set through ``option``)."""
    try:
        return read_marker(folder)
    except DamagedFileError as exc:
        raise ConvertError(exc.with_earlier_checkpoint(option)) from None
    except CheckpointFormatError as exc:
        raise ConvertError(str(exc)) from None


def _read_checkpoint_meta(folder: Path, option: str = "--ckpt") -> tuple[dict[str, Any], ModelConfig, list[int]]:
    """(complete.json, its ModelConfig, its parallel.pipeline_layers)."""
    meta = read_checkpoint_json(folder, option)
    run = meta.get("config")
    run = run if isinstance(run, dict) else {}
    if "model" not in run:
        raise ConvertError(f"{folder}/complete.json records no model config; cannot interpret its tensors")
    cfg = ModelConfig()
    apply_mapping(cfg, run["model"], f"{folder}/complete.json model config")
    return meta, cfg, list(run.get("parallel", {}).get("pipeline_layers") or [])


def read_checkpoint_config(path: str | Path, option: str = "--ckpt") -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, complete.json) of a checkpoint (a step folder or a checkpoints root with ``latest``) without
    reading its tensors; complete.json's ``config`` is the run config it was saved with. ``option``: what a
    damaged complete.json's message tells to set to an earlier checkpoint."""
    meta, cfg, _ = _read_checkpoint_meta(resolve_checkpoint_folder(path), option)
    return cfg, meta


def _checked_read(folder: Path, option: str, verify: bool, read):
    """``read()`` (which reads the checkpoint in ``folder``) with its problems as one-line ``ConvertError``s; a
    damaged file's names the checkpoint to use instead, through ``option``."""
    try:
        checksums_for(folder, verify)  # checksums.json as complete.json requires it (a warning without one)
        return read()
    except DamagedFileError as exc:
        raise ConvertError(exc.with_earlier_checkpoint(option)) from None
    except CheckpointFormatError as exc:
        raise ConvertError(str(exc)) from None


def read_full_state(path: str | Path,
                    verify: bool = True) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Full tensors, ModelConfig and complete.json of a checkpoint (weights-only or from training, any layout).
    ``verify``: check its files against ``checksums.json``, as a resume does."""
    folder = resolve_checkpoint_folder(path)
    meta, cfg, _ = _read_checkpoint_meta(folder)
    return read_model_tensors(folder, verify), cfg, meta


def read_model_tensors(folder: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint step folder ``folder``, whole (any saved layout)."""
    def read():
        full = {key.removeprefix("model."): torch.empty(shape, dtype=dtype)
                for key, (shape, dtype) in saved_tensors(folder, verify).items() if key.startswith("model.")}
        load_chunks(folder, [Chunk(f"model.{name}", tuple(t.shape), (0,) * t.ndim, t) for name, t in full.items()],
                    verify)
        return full
    return _checked_read(folder, "--ckpt", verify, read)


@torch.no_grad()
def load_model_weights(path: str | Path, mesh, model: torch.nn.Module,
                       run_model_cfg: ModelConfig | None = None, verify: bool = True,
                       adapters: bool = False, option: str = "checkpoint.load") -> dict[str, Any]:
    """Copy this rank's part of a checkpoint's weights (any layout) into ``model`` (a stage of this run,
    TP/EP plans applied). Returns complete.json. Optimizer, loader and RNG are left as the fresh run made them:
    training starts at step 0 from these weights, so call it before the optimizer copies its fp32 masters.
    ``run_model_cfg``: the run's model config, checked field by field against the checkpoint's. ``verify``:
    check the files read against ``checksums.json`` (``checkpoint.verify``). ``adapters``: also read the
    model's LoRA adapters (the checkpoint of a LoRA run, loaded to be used: generation, evaluation); without it
    they keep their initial values (a LoRA run starting from base weights; DoRA magnitudes are set to the row
    norms of the weights read, as the model's init sets them). ``option``: the key a damaged file's message tells
    to set to an earlier checkpoint."""
    folder = resolve_checkpoint_folder(path)
    meta, cfg, _ = _read_checkpoint_meta(folder, option)
    if run_model_cfg is not None:
        ours, theirs = _architecture(run_model_cfg), _architecture(cfg)
        differ = [f"model.{k}: run {ours.get(k)!r}, checkpoint {theirs.get(k)!r}"
                  for k in {**theirs, **ours} if ours.get(k) != theirs.get(k)]
        if differ:
            raise ConvertError(f"{path} does not fit this run's model config (include its model.yaml): "
                               + "; ".join(differ))
    saved = _checked_read(folder, option, verify, lambda: saved_tensors(folder, verify))
    # LoRA adapters are not in base weights: they keep their initial values (a plain holder of tensors has none)
    own_spec = model.sharding_spec() if hasattr(model, "sharding_spec") else {}
    own = {n: t for n, t in model.state_dict().items()
           if adapters or n not in own_spec or not own_spec[n].adapter}
    spec = model_family(cfg).sharding_spec(cfg)  # the checkpoint's model (its config says what it holds)
    if adapters:  # the base entries as the checkpoint's config says, the adapters' as the model places them
        spec = ShardingSpec({**{n: own_spec[n] for n in own_spec if own_spec[n].adapter}, **spec}, spec.family)
    shard = shard_of(mesh)
    for name, t in own.items():
        key = f"model.{stored_name(name, spec)}"
        if isinstance(t, torch.Tensor) and key in saved and saved[key][0] != global_shape(name, tuple(t.shape), spec, shard):
            raise ConvertError(f"{name}: checkpoint has global shape {saved[key][0]}, this rank's shard "
                               f"{tuple(t.shape)} does not fit it (does the run's model config match {path}?)")
    chunks, missing = model_load_chunks(own, spec, shard, saved)
    if missing:
        raise ConvertError(f"{path}: parameter(s) {', '.join(missing[:5])} missing from the checkpoint")
    _checked_read(folder, option, False, lambda: load_chunks(folder, chunks, verify))
    if not adapters:  # DoRA magnitudes start at the row norms of the base weights just read
        reset_dora_magnitudes(model)
    return meta


def checkpoint_lora(meta: dict[str, Any], ckpt: str | Path) -> LoraConfig | None:
    """The LoRA section (``peft.lora``) of the run that wrote a checkpoint, from its complete.json ``meta``
    (None: no adapters). A bad section is a ``ConfigError`` naming ``ckpt``'s complete.json."""
    section = ((meta.get("config") or {}).get("peft") or {}).get("lora")
    if not isinstance(section, dict):
        return None
    lora = LoraConfig()
    apply_mapping(lora, section, f"{ckpt}/complete.json peft.lora")
    return lora if lora.rank else None


def checkpoint_model_config(path: str | Path) -> tuple[Path, ModelConfig]:
    """(the step folder, its ModelConfig) of a checkpoint (a step folder or a root with ``latest``), without
    reading tensors: what a caller needs to build the model before ``load_model_weights``."""
    folder = resolve_checkpoint_folder(path)
    return folder, _read_checkpoint_meta(folder)[1]
