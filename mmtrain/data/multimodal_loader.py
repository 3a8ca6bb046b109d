"""Energon datasets and loaders for multimodal training: blend spec -> energon source, our data-parallel group ->
``WorkerConfig``, and a loader whose ``state_dict()`` resumes exactly where it stopped.

The source is one of: an energon dataset folder (``mmtrain-prep media`` output), an energon metadataset YAML
(``__class__: MetadatasetV2``, passed through unchanged), or a blend spec (docs/blend-spec.md) whose entries
all say ``type: energon``; their weights become an energon ``MetadatasetV2`` blend (leaving every weight out
weighs the datasets equally: energon sets carry no token counts to weigh by).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from mmtrain.data.blend_spec import BlendSpecError, load_blend_spec
from mmtrain.data.multimodal import MultimodalBatch, MultimodalSettings, MultimodalTaskEncoder

STATE_VERSION = 1


def _is_metadataset_yaml(path: Path) -> bool:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and "__class__" in raw


def energon_source(source: str | os.PathLike, split: str = "train") -> str | dict:
    """What to hand to energon's ``get_train_dataset``: a folder/metadataset path, or a metadataset dict."""
    path = Path(source)
    if path.is_dir():
        if not (path / ".nv-meta").is_dir():
            raise BlendSpecError(f"{path}: not an energon dataset (no .nv-meta/); write it with mmtrain-prep media")
        return str(path.resolve())
    if not path.is_file():
        raise BlendSpecError(f"{path}: multimodal data source not found; give a media shard folder, an energon "
                             "metadataset YAML or a blend spec with type: energon entries")
    if _is_metadataset_yaml(path):
        return str(path.resolve())
    spec = load_blend_spec(path)
    entries = spec.entries_for(split)
    if not entries:
        raise BlendSpecError(f"{path}: no datasets for split {split!r}")
    if spec.datasets is not None and spec.split is not None:
        raise BlendSpecError(f"{path}: 'split' does not apply to energon datasets (their splits are the shard sets "
                             "mmtrain-prep media wrote); use per-split blends (train:/valid:) instead")
    not_energon = [e for e in entries if e.type != "energon"]
    if not_energon:
        raise BlendSpecError(f"{not_energon[0].where}: {not_energon[0].path} is an indexed text dataset; the "
                             "multimodal loader reads only type: energon entries -- remove it or mark the entry")
    for e in entries:
        if not (Path(e.path) / ".nv-meta").is_dir():
            raise BlendSpecError(f"{e.where}: {e.path} has no .nv-meta/; write it with mmtrain-prep media")
    energon_split = {"valid": "val"}.get(split, split)
    blend = [{"path": e.path, "weight": float(e.weight if e.weight is not None else 1.0),
              "split_part": energon_split} for e in entries]
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2",
            "splits": {energon_split: {"blend": blend}}}


def worker_config_for(mesh=None, num_workers: int = 0, seed_offset: int = 0):
    """Energon's ``WorkerConfig`` for this rank: rank = our dp rank, world = dp size, the dp process group.
    Errors re-raise (energon's default logs and skips a failing sample)."""
    from megatron.energon import WorkerConfig, reraise_exception

    if mesh is None:
        rank, world, group = 0, 1, None
    else:
        rank, world = mesh.coord.dp, mesh.dims.dp
        group = mesh.dp_group if world > 1 else None
    return WorkerConfig(rank=rank, world_size=world, num_workers=num_workers, data_parallel_group=group,
                        seed_offset=seed_offset, global_error_handler=reraise_exception)


@dataclass(frozen=True)
class LoaderOptions:
    micro_batch_size: int = 2
    num_workers: int = 0
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = 100
    packing_buffer_size: int = 32  # samples the packer chooses from (only with settings.pack)
    seed_offset: int = 0
    prefetch_factor: int = 2


class MultimodalLoader:
    """``MultimodalBatch``-es for one data-parallel rank. ``split="train"``: an endless shuffled iterator, resumable
    exactly (``load_state_dict(state_dict())`` on a fresh loader, before its first batch, continues the same
    stream). ``"valid"``/``"test"`` (energon's ``val``/``test`` shards): one ordered pass per ``for`` loop."""

    def __init__(self, source: str | os.PathLike, settings: MultimodalSettings,
                 options: LoaderOptions = LoaderOptions(), mesh=None, split: str = "train") -> None:
        from megatron.energon import get_loader, get_savable_loader, get_train_dataset, get_val_dataset

        self.settings, self.options, self.split = settings, options, split
        self.training = split == "train"
        self.source = energon_source(source, split)
        self.task_encoder = MultimodalTaskEncoder(settings)
        self.worker_config = worker_config_for(mesh, options.num_workers, options.seed_offset)
        common = dict(split_part={"valid": "val"}.get(split, split), worker_config=self.worker_config,
                      batch_size=options.micro_batch_size, task_encoder=self.task_encoder,
                      packing_buffer_size=options.packing_buffer_size if settings.pack else None)
        if self.training:
            self.dataset = get_train_dataset(self.source, shuffle_buffer_size=options.shuffle_buffer_size or None,
                                             max_samples_per_sequence=options.max_samples_per_sequence, **common)
            self.loader = get_savable_loader(self.dataset, prefetch_factor=options.prefetch_factor)
        else:  # evaluation: one ordered pass per ``for`` loop, the same batches every time
            self.dataset = get_val_dataset(self.source, **common)
            self.loader = get_loader(self.dataset, prefetch_factor=options.prefetch_factor)
        self._iter: Iterator | None = None
        self.batches_yielded = 0

    def __iter__(self):
        return self if self.training else iter(self.loader)

    def __next__(self) -> MultimodalBatch:
        if not self.training:
            raise TypeError(f"the {self.split!r} loader is finite: iterate it with a for loop (one pass each)")
        if self._iter is None:
            self._iter = iter(self.loader)
        batch = next(self._iter)
        self.batches_yielded += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Energon's per-rank loader state (picklable; save it with the rank's checkpoint)."""
        if not self.training:
            raise TypeError(f"the {self.split!r} loader has no state: every pass reads the same batches")
        return {"version": STATE_VERSION, "energon": self.loader.save_state_rank(),
                "batches_yielded": self.batches_yielded, "dp_rank": self.worker_config.rank,
                "dp_size": self.worker_config.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._iter is not None:
            raise RuntimeError("MultimodalLoader.load_state_dict must be called before the first batch is drawn")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"multimodal loader state version {state.get('version')!r} is not {STATE_VERSION}; "
                             "it was written by another mmtrain version")
        if (state["dp_rank"], state["dp_size"]) != (self.worker_config.rank, self.worker_config.world_size):
            raise ValueError(f"multimodal loader state is of dp rank {state['dp_rank']} of {state['dp_size']} but "
                             f"this rank is {self.worker_config.rank} of {self.worker_config.world_size}; energon "
                             "per-rank states resume only on the same data-parallel layout")
        self.loader.restore_state_rank(state["energon"])
        self.batches_yielded = int(state["batches_yielded"])


def settings_from_config(data_cfg) -> MultimodalSettings:
    """``MultimodalSettings`` from ``cfg.data`` (its ``mm_*`` fields and ``seq_length``)."""
    if not data_cfg.mm_tokenizer:
        raise ValueError("data.mm_tokenizer is empty; multimodal training needs the tokenizer of the captions")
    if data_cfg.mm_image_token_id < 0:
        raise ValueError("data.mm_image_token_id is not set; give the placeholder token id of image features")
    return MultimodalSettings(
        tokenizer=data_cfg.mm_tokenizer, seq_length=data_cfg.seq_length, image_token_id=data_cfg.mm_image_token_id,
        num_image_tokens=data_cfg.mm_num_image_tokens, image_size=data_cfg.mm_image_size,
        image_mean=tuple(data_cfg.mm_image_mean), image_std=tuple(data_cfg.mm_image_std),
        audio_token_id=None if data_cfg.mm_audio_token_id < 0 else data_cfg.mm_audio_token_id,
        num_audio_tokens=data_cfg.mm_num_audio_tokens, audio_rate=data_cfg.mm_audio_rate,
        max_audio_seconds=data_cfg.mm_max_audio_seconds, video_frames=data_cfg.mm_video_frames,
        pack=data_cfg.mm_pack)


def build_multimodal_loader(cfg, mesh=None, split: str = "train") -> MultimodalLoader:
    """This rank's loader for a run config: source ``cfg.data.blend``, micro-batch ``cfg.train.micro_batch_size``,
    ``cfg.data.num_workers`` workers, energon's shuffling seeded by ``cfg.data.seed``."""
    d = cfg.data
    if not d.blend:
        raise ValueError("data.blend is empty; point it at a media shard folder, an energon metadataset YAML or a "
                         "blend spec with type: energon entries")
    options = LoaderOptions(micro_batch_size=cfg.train.micro_batch_size, num_workers=d.num_workers,
                            shuffle_buffer_size=d.mm_shuffle_buffer_size, packing_buffer_size=d.mm_packing_buffer_size,
                            seed_offset=d.seed)
    return MultimodalLoader(d.blend, settings_from_config(d), options, mesh=mesh, split=split)
