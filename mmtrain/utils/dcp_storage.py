"""The file side of our DCP checkpoints: a writer that checksums every file it writes, a reader that checks the
files it reads, and the metadata unpickler that admits DCP's metadata classes only.

Checksums: each rank's writer threads hash the ``.distcp`` bytes as they write them
(``mmtrain.utils.file_checksums.HashingFile``); the records travel to the coordinator with DCP's own write
results, and the coordinator writes ``checksums.json`` (every ``.distcp``, ``.metadata`` and the per-rank
files the caller names) right after ``.metadata``, so before the checkpoint is marked complete. A reader checks
``.metadata`` before unpickling it and every data file before DCP reads from it; a checkpoint without
``checksums.json`` (written before checksums existed) is read unchecked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import pickle
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.file_checksums import HashingFile, file_problem, read_record, record_text

CHECKSUMS_NAME = "checksums.json"
METADATA_NAME = ".metadata"
_RECORD_KEY = "__mmtrain_checksums__"  # the write result carrying a rank's checksums to the coordinator


class CheckpointFormatError(ValueError):
    """A checkpoint folder that is not what the reader needs; the message names the folder and key."""


class DamagedFileError(CheckpointFormatError):
    """A checkpoint file that is missing or does not match the checksum recorded when it was written."""

    def __init__(self, folder: Path, name: str, problem: str) -> None:
        super().__init__(f"{Path(folder) / name} {problem}")
        self.folder, self.name, self.problem = Path(folder), name, problem

    def with_earlier_checkpoint(self, option: str = "checkpoint.load") -> str:
        """This error, and the checkpoint to use instead (set through ``option``), in one line."""
        earlier = earlier_complete_checkpoint(self.folder)
        instead = (f"the previous complete checkpoint is {earlier} ({option}={earlier})" if earlier is not None
                   else "there is no earlier complete checkpoint")
        return f"{self}; {instead}"


# ------------------------------------------------------------------------------------------------- writing
class _HashingFileSystem(FileSystem):
    """DCP's local file system whose write streams record the XXH3 hash of what goes through them, by file name."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = HashingFile(stream, background=True)
            yield hashing
        with self.lock:
            self.sums[Path(path).name] = hashing.entry()

    def rename(self, path, new_path) -> None:  # .metadata is written as .metadata.tmp, then renamed
        super().rename(path, new_path)
        with self.lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksummingFileSystemWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` that records a checksum of every file it writes in ``checksums.json``.

    ``extra_checksums``: records (``file_checksums.hash_entry``) of files this rank wrote beside DCP's (its
    ``rank_XXXXX.json``), added to the record; set it before each save."""

    def __init__(self, path, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _HashingFileSystem()
        self.extra_checksums: dict[str, dict[str, Any]] = {}

    def write_data(self, plan, planner) -> Future:
        with self.fs.lock:
            self.fs.sums.clear()
        results = list(super().write_data(plan, planner).wait())  # DCP's file writer has finished when it returns
        with self.fs.lock:
            sums = {**self.fs.sums, **self.extra_checksums}
        results.append(WriteResult(index=MetadataIndex(_RECORD_KEY), size_in_bytes=0, storage_data=sums))
        done: Future = Future()  # torch.futures: what DCP's writer API returns
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        sums: dict[str, dict[str, Any]] = {}
        kept = []
        for rank_results in results:
            for r in rank_results:
                if r.index.fqn == _RECORD_KEY:
                    sums.update(r.storage_data)
            kept.append([r for r in rank_results if r.index.fqn != _RECORD_KEY])
        super().finish(metadata, kept)
        with self.fs.lock:
            sums[METADATA_NAME] = self.fs.sums.pop(METADATA_NAME)
        atomic_write_text(Path(self.path) / CHECKSUMS_NAME, record_text(sums))


# ------------------------------------------------------------------------------------------------- reading
def read_checksums(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The checkpoint's checksum records by file name; None for a checkpoint written before checksums existed."""
    try:
        return read_record(Path(folder) / CHECKSUMS_NAME)
    except ValueError as exc:
        raise CheckpointFormatError(str(exc)) from None


def check_file(folder: Path, name: str, checksums: dict[str, dict[str, Any]] | None) -> None:
    """Raise ``DamagedFileError`` when ``folder/name`` is missing or (with ``checksums``) does not match them."""
    if checksums is None or name not in checksums:
        if checksums is not None:
            raise DamagedFileError(folder, name, f"has no checksum in {CHECKSUMS_NAME} (the record is incomplete)")
        if not (Path(folder) / name).is_file():
            raise DamagedFileError(folder, name, "is missing")
        return
    problem = file_problem(Path(folder) / name, checksums[name])
    if problem:
        raise DamagedFileError(folder, name, problem)


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata file is a pickle: admit exactly the (module, name) pairs DCP's metadata is made of.

    No dotted names (pickle would resolve ``a.b`` attribute by attribute, out of the allowed object), no
    whole modules: every other global is refused before it is looked up, so no code from the file runs."""

    ALLOWED = frozenset({
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
        *(("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")})

    def find_class(self, module: str, name: str):
        if "." in name or (module, name) not in self.ALLOWED:
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise _RefusedGlobal(f"persistent id {pid!r}")


def read_metadata(folder: Path, verify: bool = True) -> Metadata:
    """DCP's metadata of the checkpoint in ``folder`` (checked against ``checksums.json`` first when
    ``verify`` and the record exists); ``CheckpointFormatError`` naming the file for anything else."""
    folder = Path(folder)
    path = folder / METADATA_NAME
    if not path.is_file():
        raise DamagedFileError(folder, METADATA_NAME, "is missing (no DCP metadata: not a complete "
                                                      "torch.distributed.checkpoint folder)")
    if verify:
        check_file(folder, METADATA_NAME, read_checksums(folder))
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _RefusedGlobal as exc:
        raise CheckpointFormatError(f"{path}: refusing to load {exc} (checkpoint metadata may hold DCP's metadata "
                                    "classes only); the file is damaged or hostile, do not use it") from None
    except Exception as exc:  # noqa: BLE001 - a hostile or broken file: any failure is the file's
        raise CheckpointFormatError(f"{path}: not a valid DCP metadata file ({type(exc).__name__}: {exc}); "
                                    "the file is damaged or not from torch.distributed.checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class VerifyingFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` that reads metadata through ``_MetadataUnpickler`` and checks each data file it is
    about to read: present, and (with ``checksums``) matching its record."""

    def __init__(self, path, checksums: dict[str, dict[str, Any]] | None) -> None:
        super().__init__(path)
        self.checksums = checksums

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path), verify=False)  # load_chunks checked it (when verifying)
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name in sorted(per_file):
            if Path(name).name != name or name in (".", ".."):
                raise CheckpointFormatError(f"{self.path}/{METADATA_NAME}: data file name {name!r} is not a "
                                            "plain file name in the checkpoint folder")
        names = sorted(per_file)  # the files are checked in parallel (reading and hashing release the GIL) ...
        with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(names)))) as pool:
            checks = [pool.submit(check_file, Path(self.path), name, self.checksums) for name in names]
            for check in checks:  # ... and the first damaged one in name order is the one reported
                check.result()
        for name, items in sorted(per_file.items()):  # file by file, so that a failure names its file
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:  # noqa: BLE001 - unchecked (no record, or verify off) and unreadable
                first = (str(exc).splitlines() or [""])[0]
                raise CheckpointFormatError(f"{Path(self.path) / name}: could not be read ({type(exc).__name__}: "
                                            f"{first}); the file is damaged") from None
        done: Future = Future()
        done.set_result(None)
        return done


def earlier_complete_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (``step_*`` with ``complete.json``) of ``folder``'s root older than it."""
    folder = Path(folder)
    older = sorted(p for p in folder.parent.glob("step_*") if p.name < folder.name and (p / "complete.json").is_file())
    return older[-1] if older else None
