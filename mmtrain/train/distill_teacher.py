"""The distillation teacher (``distill.teacher``): its checkpoint checked before the run starts, and built frozen.

``check_teacher`` reads the checkpoint's ``complete.json`` only (no tensors): its model (any family and size), its
shape against the run's layout, its vocabulary against the student's and its tokenizer against the one the
student's data was prepared with (``mmtrain.core.tokenizer_record``: the checksum, else the same ids for probe
texts), each problem one ``ConfigError`` line naming ``distill.teacher``. ``build_teacher`` makes the whole teacher
on the ranks of the last pipeline stage (where the student's logits are), sharded over TP / EP / CP exactly as the
student (``build_whole_model``) and over data-parallel ranks with ``parallel.fsdp`` (its blocks gathered for their
forward only); its weights read from the checkpoint (a LoRA run's adapters merged), in the run's weight dtype,
frozen (no gradients, no optimizer state), its head returning the logits as they are sharded (``TeacherHead``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.config.schema import GPTRunConfig, LoraConfig, ModelConfig
from mmtrain.convert.checkpoint_io import (ConvertError, checkpoint_lora, load_model_weights, read_checkpoint_config,
                                           resolve_checkpoint_folder)
from mmtrain.core.manifest import ManifestError
from mmtrain.core.tokenizer_record import checkpoint_tokenizer_record, describe_record, same_tokenizer
from mmtrain.models.registry import model_family
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.train.build import build_whole_model
from mmtrain.train.distill_loss import TeacherHead
from mmtrain.train.fsdp_setup import fully_sharded_frozen


@dataclass
class TeacherCheckpoint:
    """What ``complete.json`` says of the teacher: its step folder, model and LoRA section (None: no adapters)."""

    folder: Path
    model: ModelConfig
    lora: LoraConfig | None
    meta: dict[str, Any]


def read_teacher(cfg: GPTRunConfig) -> TeacherCheckpoint:
    """The teacher's checkpoint as ``distill.teacher`` names it, its model checked against the run."""
    given = cfg.distill.teacher
    key = f"distill.teacher={given}"
    path = Path(given)
    if not path.exists():
        raise ConfigError(f"{key}: no such checkpoint (looked for {path.resolve()}); give the teacher's mmtrain "
                          "checkpoint (a checkpoints root with latest, or a step folder)")
    if (path / "config.json").is_file() and not (path / "latest").is_file():
        raise ConfigError(f"{key}: a Hugging Face model folder, not an mmtrain checkpoint; convert it first "
                          f"(python -m mmtrain.convert hf-to-mmtrain --hf {given} --out CKPT) and set "
                          "distill.teacher=CKPT")
    try:
        folder = resolve_checkpoint_folder(path)
        model, meta = read_checkpoint_config(folder, option="distill.teacher")
        lora = checkpoint_lora(meta, folder)
        shape = model.shape().check(prefix=f"{key} (its complete.json) model.")
    except (ConvertError, ConfigError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    student = cfg.model.shape()
    if shape.vocab_size != student.vocab_size:
        raise ConfigError(f"{key}: the teacher has a vocabulary of {shape.vocab_size} ids, the student "
                          f"{student.vocab_size} ({cfg.model.shape_prefix()}vocab_size); distillation compares both "
                          "models' probabilities of the same ids: use a teacher of the student's tokenizer and "
                          "vocab_size")
    parallel = cfg.parallel if model_family(model).has_routed_experts(model) else dataclasses.replace(cfg.parallel, ep=1)
    try:
        if cfg.parallel.cp > 1 and not shape.supports_cp:
            raise ConfigError(f"parallel.cp={cfg.parallel.cp} is not supported for its family {model.family}")
        shape.check_layout(parallel, prefix="model.")
    except ConfigError as exc:
        raise ConfigError(f"{key}: the teacher is sharded like the student, and its model does not fit the run's "
                          f"layout: {exc}") from None
    return TeacherCheckpoint(folder, model, lora, meta)


def check_teacher(cfg: GPTRunConfig) -> TeacherCheckpoint:
    """``read_teacher``, and the teacher's tokenizer is the one the student's data was prepared with (checked when
    the data names one: mock data has none)."""
    from mmtrain.data.blend import data_tokenizer  # the data's manifests (not read for mock data)

    teacher = read_teacher(cfg)
    key = f"distill.teacher={cfg.distill.teacher}"
    try:
        student = data_tokenizer(cfg)
        found = checkpoint_tokenizer_record(teacher.meta)
    except ManifestError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if student is None:
        return teacher
    if found is None:
        raise ConfigError(f"{key}: the teacher's checkpoint names no tokenizer (neither its complete.json nor a "
                          f"data manifest of its run records one), so it cannot be checked against the student's data "
                          f"({describe_record(student)}); use a teacher trained or converted with that tokenizer")
    record, where = found
    if not same_tokenizer(record, student):
        raise ConfigError(f"{key}: the teacher was trained with another tokenizer ({describe_record(record)}, from "
                          f"its {where}) than the student's data ({describe_record(student)}); the two models' "
                          "token ids would mean different text: distill from a teacher of the same tokenizer")
    return teacher


def teacher_run_config(cfg: GPTRunConfig, teacher: TeacherCheckpoint) -> GPTRunConfig:
    """The run config the teacher is built with: its model (and adapters), the student's layout and options,
    every layer on one stage, no recompute (it runs forward only)."""
    lora = teacher.lora or dataclasses.replace(cfg.peft.lora, rank=0, dora=False)
    return dataclasses.replace(
        cfg, model=teacher.model, peft=dataclasses.replace(cfg.peft, lora=lora),
        train=dataclasses.replace(cfg.train, activation_checkpointing="none"),
        parallel=dataclasses.replace(cfg.parallel, pipeline_layers=[], virtual_pp=1))


def build_teacher(cfg: GPTRunConfig, teacher: TeacherCheckpoint, mesh: ParallelMesh, device: torch.device,
                  param_dtype: torch.dtype) -> torch.nn.Module | None:
    """The frozen teacher (``read_teacher``'s) on the last pipeline stage's ranks (None on the others), ready for
    forward passes under ``torch.no_grad``: ``teacher(tokens, None, positions, doc_ids)`` gives its logits, this
    rank's vocabulary range."""
    if mesh.coord.pp != mesh.dims.pp - 1:
        return None
    from mmtrain.model.lora import merge_adapters  # as mmtrain.inference.loading merges a LoRA run's adapters

    model = build_whole_model(teacher_run_config(cfg, teacher), mesh, device, param_dtype)  # the run's weight dtype
    try:
        load_model_weights(teacher.folder, mesh, model, run_model_cfg=teacher.model, verify=cfg.checkpoint.verify,
                           adapters=teacher.lora is not None, option="distill.teacher")
    except ConvertError as exc:  # a damaged or missing file: one line naming the key
        raise ConfigError(f"distill.teacher={cfg.distill.teacher}: {exc}") from None
    if teacher.lora is not None:
        merge_adapters(model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.swap_head(lambda head, vocab_size: TeacherHead(head))
    if cfg.parallel.fsdp:  # sharded like the student: each block gathered for its forward only
        fully_sharded_frozen(model, mesh)
    return model.eval()
