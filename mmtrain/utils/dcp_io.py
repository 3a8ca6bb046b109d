"""Boxes of global tensors in and out of a ``torch.distributed.checkpoint`` (DCP) folder.

Each rank hands over a list of ``Chunk``s — (global name, global shape, offsets of the box, the box's values) —
and DCP does the rest: a save gathers every rank's boxes into one metadata file (identical boxes of replicas
are written once), a load reads whichever saved boxes overlap the requested ones, so any layout can read a
checkpoint written by any other. We use DCP's planner interface with our own boxes instead of DTensors
because our tensor-parallel shards of fused weights (q|k|v, gate|up) and the distributed optimizer's flat
ranges are several boxes per rank, which placements cannot describe.

Loading unpickles nothing but DCP's own metadata classes (``read_metadata``), and DCP reads tensors with
``torch.load(weights_only=True)``. Every file is checksummed as it is written and checked before it is read
(``mmtrain.utils.dcp_storage``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from mmtrain.utils.dcp_storage import (  # noqa: F401 - CheckpointFormatError, read_metadata: re-exported
    ChecksummingFileSystemWriter,
    CheckpointFormatError,
    VerifyingFileSystemReader,
    read_checksums,
    read_metadata,
)


@dataclass
class Chunk:
    key: str  # global name
    shape: tuple[int, ...]  # of the whole global tensor
    offsets: tuple[int, ...]  # of this box in it; the box's sizes are tensor.shape
    tensor: torch.Tensor  # values to save, or the destination (a view is fine) to load into


class _ChunkSavePlanner(DefaultSavePlanner):
    """Saves state dict entry ``name`` as the box at ``offsets`` of global tensor ``key`` of ``shape``
    (``boxes[name] = (key, shape, offsets)``). The values come through the state dict, so DCP's own
    ``async_save`` can stage them to host memory first."""

    def __init__(self, boxes: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes
        self.entry = {(key, tuple(offsets)): name for name, (key, _, offsets) in boxes.items()}
        if len(self.entry) != len(boxes):
            raise ValueError("two chunks with the same key and offsets")

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, (key, shape, offsets) in self.boxes.items():
            t = self.state_dict[name]
            items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                                       properties=TensorProperties.create_from_tensor(t), size=torch.Size(shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.state_dict[self.entry[(write_item.index.fqn, tuple(write_item.index.offset))]]


def _save_plan_of(chunks: list[Chunk]) -> tuple[dict[str, torch.Tensor], _ChunkSavePlanner]:
    """(state dict, planner) to hand to ``dcp.save`` or ``dcp.async_save`` for ``chunks``."""
    names = [f"{i:06d}" for i in range(len(chunks))]
    return ({n: c.tensor for n, c in zip(names, chunks)},
            _ChunkSavePlanner({n: (c.key, tuple(c.shape), tuple(c.offsets)) for n, c in zip(names, chunks)}))


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: list[Chunk], folder: Path) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.folder = chunks, folder

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for i, c in enumerate(self.chunks):
            want = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.shape)
            found = create_read_items_for_chunk_list(c.key, saved[c.key], [want])
            if sum(_volume(r.lengths) for r in found) != c.tensor.numel():
                raise CheckpointFormatError(f"{self.folder}: '{c.key}' box at {c.offsets} is not fully saved")
            items += [replace(r, dest_index=MetadataIndex(c.key, c.offsets, i)) for r in found]
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.chunks[read_item.dest_index.index].tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: the values are already in place


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def saved_tensors(folder: Path, verify: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{global name: (shape, dtype)} of every tensor in the checkpoint."""
    return {k: (tuple(v.size), v.properties.dtype) for k, v in read_metadata(folder, verify).state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def save_chunks(folder: Path, chunks: list[Chunk], group=None, no_dist: bool = False, thread_count: int = 1,
                checksums: bool = True, extra_checksums: dict | None = None) -> None:
    """Collective over ``group`` (every rank calls it; none with ``no_dist``): write the chunks of every rank as
    one DCP checkpoint in ``folder``. Returns after the coordinator wrote the metadata (and ``checksums.json``:
    a record of every file, with ``extra_checksums`` of this rank's own files), i.e. after every rank's data is
    on disk. ``checksums=False`` only for measuring what they cost (``bench/checkpoint.py``)."""
    kind = ChecksummingFileSystemWriter if checksums else dcp.FileSystemWriter
    writer = kind(folder, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
    if checksums:
        writer.extra_checksums = dict(extra_checksums or {})
    state, planner = _save_plan_of(chunks)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)


def async_save_chunks(folder: Path, chunks: list[Chunk], writer: ChecksummingFileSystemWriter, group=None,
                      extra_checksums: dict | None = None):
    """``dcp.async_save`` of ``chunks`` (collective like ``save_chunks``): returns once DCP copied the values to
    host memory (the writer's staging); the returned future completes when the checkpoint is written."""
    writer.extra_checksums = dict(extra_checksums or {})
    state, planner = _save_plan_of(chunks)
    return dcp.async_save(state, checkpoint_id=folder, storage_writer=writer, planner=planner, process_group=group,
                          no_dist=group is None)


def load_chunks(folder: Path, chunks: list[Chunk], verify: bool = True) -> None:
    """Fill each chunk's tensor with its box of the saved global tensor (this rank alone: no collectives).
    ``verify``: check ``.metadata`` and every file read against ``checksums.json`` (when the checkpoint has
    one); a missing or damaged file raises ``DamagedFileError``."""
    checksums = read_checksums(folder) if verify else None
    saved = read_metadata(folder, verify).state_dict_metadata
    for c in chunks:  # checked here: DCP would wrap these errors into a generic exception
        md = saved.get(c.key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"{folder}: the checkpoint has no tensor '{c.key}'")
        if tuple(md.size) != tuple(c.shape):
            raise CheckpointFormatError(f"{folder}: '{c.key}' has shape {tuple(md.size)} in the checkpoint, "
                                        f"{tuple(c.shape)} here (does the model config match?)")
    if not chunks:
        return
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=VerifyingFileSystemReader(folder, checksums),
                     planner=_LoadPlanner(chunks, Path(folder)), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what the planner or reader raised: raise our one-line error
        for error, _ in exc.failures.values():
            if isinstance(error, CheckpointFormatError):
                raise error from None
        raise
