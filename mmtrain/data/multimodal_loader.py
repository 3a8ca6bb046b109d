"""Energon datasets and loaders for multimodal training: blend spec -> energon source, and this rank's loader.
Training reads one global order of energon slices (``mmtrain.data.multimodal_slices``) that no worker count or
data-parallel size changes, and resumes exactly, also at another data-parallel size; validation is energon's own
loader over this rank's shards (``WorkerConfig`` from our data-parallel group).

The source is one of: an energon dataset folder (``mmtrain-prep media`` output), an energon metadataset YAML
(``__class__: MetadatasetV2``, passed through unchanged), or a blend spec (docs/blend-spec.md) whose entries
all say ``type: energon``; their weights become an energon ``MetadatasetV2`` blend (leaving every weight out
weighs the datasets equally: energon sets carry no token counts to weigh by).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mmtrain.data.blend_spec import BlendSpecError, load_blend_spec
from mmtrain.data.multimodal import (
    MultimodalBatch,
    MultimodalSettings,
    MultimodalTaskEncoder,
)
from mmtrain.data.multimodal_slices import (
    InProcessReader,
    SliceSpec,
    WorkerPoolReader,
    expected_batches,
    rank_slices,
)

STATE_VERSION = 2


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


def _worker_config_for(mesh=None, num_workers: int = 0, seed_offset: int = 0):
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
    shuffle_buffer_size: int = 100  # per slice
    max_samples_per_sequence: int | None = 100
    packing_buffer_size: int = 32  # samples the packer chooses from, per slice (only with settings.pack)
    seed_offset: int = 0
    prefetch_factor: int = 2  # batches each worker process keeps ready
    num_slices: int = 16  # the order's slices; a multiple of every data-parallel size the run may use


class MultimodalLoader:
    """``MultimodalBatch``-es for one data-parallel rank.

    ``split="train"``: an endless shuffled iterator over one global order (``mmtrain.data.multimodal_slices``)
    that is the same for every data-parallel size dividing ``options.num_slices`` and every worker count.
    ``state_dict()`` is this rank's part of the state; ``global_state_dict()`` (collective over the dp group)
    or ``merge_loader_states`` gives the whole state, which ``load_state_dict`` on a fresh loader, before its first
    batch, continues exactly, also at another data-parallel size. ``"valid"``/``"test"`` (energon's ``val``/``test``
    shards): one ordered pass per ``for`` loop, read by energon's loader over this rank's shards."""

    def __init__(self, source: str | os.PathLike, settings: MultimodalSettings,
                 options: LoaderOptions = LoaderOptions(), mesh=None, split: str = "train") -> None:
        self.settings, self.options, self.split, self.mesh = settings, options, split, mesh
        self.training = split == "train"
        self.source = energon_source(source, split)
        self.task_encoder = MultimodalTaskEncoder(settings)
        self.worker_config = _worker_config_for(mesh, options.num_workers, options.seed_offset)
        self.dp_rank, self.dp_size = self.worker_config.rank, self.worker_config.world_size
        if options.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {options.num_workers}")
        if self.training:
            s = options.num_slices
            if s < 1 or s % self.dp_size:
                raise ValueError(f"media.slices ({s}) must be a positive multiple of the data-parallel size "
                                 f"({self.dp_size}): the multimodal order has that many slices and each rank reads "
                                 "its share; use a multiple of every data-parallel size the run may resume at")
            self.spec = SliceSpec(source=self.source, settings=settings, num_slices=s,
                                  micro_batch_size=options.micro_batch_size,
                                  shuffle_buffer_size=options.shuffle_buffer_size,
                                  max_samples_per_sequence=options.max_samples_per_sequence,
                                  packing_buffer_size=options.packing_buffer_size, seed=options.seed_offset)
            self._start = 0  # global micro-batches consumed when this loader started (0, or a loaded state's)
            self._taken = 0  # micro-batches this rank has taken since
            self._restored: dict[int, dict] = {}
            self._reader = None
            # fail early on a source energon cannot split into the slices (the reader rebuilds them)
            InProcessReader(self.spec, rank_slices(0, self.dp_rank, self.dp_size, s), {})
        else:  # evaluation: one ordered pass per ``for`` loop, the same batches every time
            from megatron.energon import get_loader, get_val_dataset

            self.dataset = get_val_dataset(
                self.source, split_part={"valid": "val"}.get(split, split), worker_config=self.worker_config,
                batch_size=options.micro_batch_size, task_encoder=self.task_encoder,
                packing_buffer_size=options.packing_buffer_size if settings.pack else None)
            self.loader = get_loader(self.dataset, prefetch_factor=options.prefetch_factor)

    # ---- training ---------------------------------------------------------------------------------------

    @property
    def consumed_micro_batches(self) -> int:
        """Global micro-batches consumed when every rank has taken as many as this one (the lockstep count)."""
        return self._start + self._taken * self.dp_size

    @property
    def first_micro_batch(self) -> int:
        """Global micro-batches consumed when this loader started (0, or the loaded state's): this rank takes
        micro-batches ``first_micro_batch + dp_rank + k * dp`` for k = 0, 1, ..."""
        return self._start

    @property
    def batches_yielded(self) -> int:
        """Micro-batches per rank so far at the current data-parallel size (global count / dp)."""
        return self.consumed_micro_batches // self.dp_size

    def _taken_by_rank_at(self, consumed: int) -> int:
        """How many micro-batches this rank has taken once global micro-batches ``0 .. consumed-1`` are consumed
        (it takes ``start + dp_rank + k * dp`` for k = 0, 1, ...)."""
        return max(0, -(-(consumed - self._start - self.dp_rank) // self.dp_size))

    def __iter__(self):
        return self if self.training else iter(self.loader)

    def __next__(self) -> MultimodalBatch:
        if not self.training:
            raise TypeError(f"the {self.split!r} loader is finite: iterate it with a for loop (one pass each)")
        mine = self.consumed_micro_batches + self.dp_rank
        if self._reader is None:
            order = rank_slices(self._start, self.dp_rank, self.dp_size, self.spec.num_slices)
            if self.options.num_workers == 0:
                self._reader = InProcessReader(self.spec, order, self._restored)
            else:
                self._reader = WorkerPoolReader(self.spec, order, self._restored, self.options.num_workers,
                                                self.options.prefetch_factor)
        batch = self._reader.next(mine % self.spec.num_slices)
        self._taken += 1
        return batch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's part of the loader state: JSON-compatible, the same ``consumed_micro_batches`` on every
        rank, the states of the slices this rank reads. Merge all dp ranks' parts (``global_state_dict``) to
        resume at another data-parallel size.

        ``consumed``: the global count of consumed micro-batches when the ranks do not take them in lockstep
        (a VLM's media rows: a rank takes as many per step as its rows need, always the next of its own
        ``start + dp_rank (mod dp)`` sequence); this rank must have taken exactly its share of them."""
        if not self.training:
            raise TypeError(f"the {self.split!r} loader has no state: every pass reads the same batches")
        if consumed is None:
            consumed = self.consumed_micro_batches
        elif consumed < self._start or self._taken_by_rank_at(consumed) != self._taken:
            raise ValueError(f"multimodal loader state at {consumed} consumed micro-batches: data-parallel rank "
                             f"{self.dp_rank} has taken {self._taken} since {self._start}, not its share "
                             f"{self._taken_by_rank_at(consumed)}; the ranks are out of step (a bug)")
        states = dict(self._restored) if self._reader is None else {**self._restored, **self._reader.states()}
        mine = set(rank_slices(self._start, self.dp_rank, self.dp_size, self.spec.num_slices))
        return {"version": STATE_VERSION, "consumed_micro_batches": consumed,
                "micro_batch_size": self.spec.micro_batch_size, "num_slices": self.spec.num_slices,
                "seed": self.spec.seed, "slices": {str(s): st for s, st in sorted(states.items()) if s in mine}}

    def global_state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The whole loader state (every slice), the same on every rank: collective over the dp group. Save it
        once per checkpoint (it is replicated); any data-parallel size dividing ``num_slices`` resumes from it.
        ``consumed``: as for ``state_dict``."""
        return self.gather_state_dicts(self.state_dict(consumed))

    def gather_state_dicts(self, own: dict[str, Any]) -> dict[str, Any]:
        """The whole loader state from every rank's ``state_dict`` (each taken at the same global count; a
        prefetching reader takes its own ahead of time): collective over the dp group."""
        if self.dp_size == 1:
            return own
        import torch.distributed as dist

        parts: list = [None] * self.dp_size
        dist.all_gather_object(parts, own, group=self.worker_config.data_parallel_group)
        return merge_loader_states(parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state of ``state_dict``/``global_state_dict``, before the first batch is drawn."""
        if not self.training:
            raise TypeError(f"the {self.split!r} loader has no state: every pass reads the same batches")
        if self._reader is not None:
            raise RuntimeError("MultimodalLoader.load_state_dict must be called before the first batch is drawn")
        _check_state_shape(state)
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"multimodal loader state version {state.get('version')!r} is not {STATE_VERSION}; it "
                             "was written by another mmtrain version (version 1: energon per-rank states), whose "
                             "order this loader cannot continue -- start the data from the beginning")
        for key, mine, what in (("num_slices", self.spec.num_slices, "media.slices"),
                                ("micro_batch_size", self.spec.micro_batch_size, "train.micro_batch_size"),
                                ("seed", self.spec.seed, "data.seed")):
            if state[key] != mine:
                raise ValueError(f"the multimodal loader state was saved with {what} = {state[key]}, this run has "
                                 f"{mine}; the order depends on it -- set it back to resume")
        consumed = int(state["consumed_micro_batches"])
        slices = {int(s): st for s, st in state["slices"].items()}
        restored = {}
        for s in rank_slices(consumed, self.dp_rank, self.dp_size, self.spec.num_slices):
            want = expected_batches(s, self.spec.num_slices, consumed)
            if want == 0:
                continue
            if s not in slices:
                raise ValueError(f"the multimodal loader state has no state for slice {s}, which this rank "
                                 f"({self.dp_rank} of {self.dp_size}) reads next; it is one rank's part -- save "
                                 "loader.global_state_dict() to resume at another data-parallel size")
            if int(slices[s]["batches"]) != want:
                raise ValueError(f"multimodal loader state: slice {s} has given {slices[s]['batches']} batches, "
                                 f"but {want} after {consumed} consumed micro-batches; the state is inconsistent")
            restored[s] = slices[s]
        self._start, self._taken, self._restored = consumed, 0, restored

    def close(self) -> None:
        """Stop the worker processes (also done when the loader is garbage-collected)."""
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the queues may be gone; workers are daemons
            self.close()


_STATE_KEYS = {"version": int, "consumed_micro_batches": int, "micro_batch_size": int, "num_slices": int,
               "seed": int, "slices": dict}


def _check_state_shape(state: Any) -> None:
    """A state that is not what ``state_dict`` writes (edited, truncated, another program's) is a one-line
    ``ValueError`` naming the key, never a ``KeyError`` from deep inside."""
    if not isinstance(state, dict):
        raise ValueError(f"the multimodal loader state is a {type(state).__name__}, not a mapping; it is damaged")
    if state.get("version") != STATE_VERSION:
        return  # the version message says more
    for key, kind in _STATE_KEYS.items():
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"the multimodal loader state's {key!r} is {value!r}, not a {kind.__name__}; the state "
                             "is damaged -- resume from an earlier checkpoint")
    if state["consumed_micro_batches"] < 0:
        raise ValueError(f"the multimodal loader state's 'consumed_micro_batches' is {state['consumed_micro_batches']}")
    for key, slice_state in state["slices"].items():
        if (not str(key).isdigit() or not isinstance(slice_state, dict) or "energon" not in slice_state
                or not isinstance(slice_state.get("batches"), int)):
            raise ValueError(f"the multimodal loader state's slice {key!r} is not a slice state (batches and "
                             "energon); the state is damaged -- resume from an earlier checkpoint")


def merge_loader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from the ``state_dict()`` of every data-parallel rank (ranks holding the same slice must agree)."""
    first = states[0]
    merged = {k: v for k, v in first.items() if k != "slices"}
    slices: dict[str, Any] = {}
    for st in states:
        for key in ("version", "consumed_micro_batches", "micro_batch_size", "num_slices", "seed"):
            if st.get(key) != first.get(key):
                raise ValueError(f"multimodal loader states of the ranks differ in {key!r} ({first.get(key)} vs "
                                 f"{st.get(key)}); were they saved at the same step?")
        for s, slice_state in st["slices"].items():
            if s in slices and slices[s] != slice_state:
                raise ValueError(f"multimodal loader states of two ranks differ for slice {s}")
            slices[s] = slice_state
    merged["slices"] = dict(sorted(slices.items(), key=lambda kv: int(kv[0])))
    return merged


def settings_from_config(media, model, seq_length: int) -> MultimodalSettings:
    """``MultimodalSettings`` from a VLM run's ``media`` section (a ``MediaConfig``), the placeholder settings
    its ``model`` (a ``VLMModelConfig``) decides (image size, token ids, tokens per image and audio clip, audio
    rate) and ``data.seq_length``."""
    if not media.tokenizer:
        raise ValueError("media.tokenizer is empty; multimodal training needs the tokenizer of the captions")
    if model.image_token_id < 0:
        raise ValueError("model.image_token_id is not set; give the placeholder token id of image features")
    audio = model.audio
    return MultimodalSettings(
        tokenizer=media.tokenizer, seq_length=seq_length, image_token_id=model.image_token_id,
        num_image_tokens=model.tokens_per_image, image_size=model.vision.image_size,
        image_mean=tuple(media.image_mean), image_std=tuple(media.image_std),
        audio_token_id=model.audio_token_id if audio.enabled else None,
        num_audio_tokens=audio.num_tokens, audio_rate=audio.sample_rate,
        max_audio_seconds=media.max_audio_seconds, video_frames=media.video_frames, pack=media.pack)


def build_multimodal_loader(data, media, model, micro_batch_size: int, mesh=None,
                            split: str = "train") -> MultimodalLoader:
    """This rank's loader for a VLM run's sections: source ``data.blend``, ``data.num_workers`` workers, energon's
    shuffling seeded by ``data.seed``, the ``media`` section (``MediaConfig``) and the placeholders its ``model``
    (``VLMModelConfig``) decides."""
    if not data.blend:
        raise ValueError("data.blend is empty; point it at a media shard folder, an energon metadataset YAML or a "
                         "blend spec with type: energon entries")
    options = LoaderOptions(micro_batch_size=micro_batch_size, num_workers=data.num_workers,
                            shuffle_buffer_size=media.shuffle_buffer_size,
                            packing_buffer_size=media.packing_buffer_size, seed_offset=data.seed,
                            num_slices=media.slices)
    return MultimodalLoader(data.blend, settings_from_config(media, model, data.seq_length), options, mesh=mesh,
                            split=split)
