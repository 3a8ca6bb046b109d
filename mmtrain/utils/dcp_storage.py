"""The file side of our DCP checkpoints: a writer that checksums every file it writes, a reader that checks the
files it reads, and the metadata unpickler that admits DCP's metadata classes only.

Checksums: each rank's writer threads hash the ``.distcp`` bytes as they write them
(``mmtrain.utils.file_checksums.HashingFile``); the records travel to the coordinator with DCP's own write
results, and the coordinator writes ``checksums.json`` (every ``.distcp``, ``.metadata`` and the per-rank
files the caller names) right after ``.metadata``, so before the checkpoint is marked complete. A reader checks
``.metadata`` before unpickling it and every data file before DCP reads from it. Whether a checkpoint must have
``checksums.json`` is its ``complete.json``'s to say (``mmtrain.utils.checkpoint_marker``): one written before
checksums is read unchecked.

Sizes: after unpickling, every tensor the metadata describes is checked against the bytes its data files hold
(``_check_sizes``) before anyone allocates a tensor of that size: its stored chunks must lie inside the tensor,
cover it, and fit their byte ranges, which must lie inside the files without overlapping.
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
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.checkpoint_marker import (  # noqa: F401 - the errors and read_checksums: re-exported
    CHECKSUMS_NAME,
    METADATA_NAME,
    CheckpointFormatError,
    DamagedFileError,
    earlier_complete_checkpoint,
    read_checksums,
)
from mmtrain.utils.file_checksums import HashingFile, file_problem, record_text, size_problem

_RECORD_KEY = "__mmtrain_checksums__"  # the write result carrying a rank's checksums to the coordinator


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
    ``verify`` and the record exists), its sizes checked against the data files (``_check_sizes``);
    ``CheckpointFormatError`` naming the file for anything else."""
    folder = Path(folder)
    path = folder / METADATA_NAME
    if not path.is_file():
        raise DamagedFileError(folder, METADATA_NAME, "is missing (no DCP metadata: not a complete "
                                                      "torch.distributed.checkpoint folder)")
    checksums = read_checksums(folder) if verify else None
    if verify:
        check_file(folder, METADATA_NAME, checksums)
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
    _check_sizes(folder, metadata, checksums)
    return metadata


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _sizes(value, ndim: int | None = None) -> tuple[int, ...] | None:
    """``value`` as a tuple of non-negative ints (of ``ndim`` entries when given), None when it is not one."""
    try:
        out = tuple(value)
    except TypeError:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in out):
        return None
    return out if ndim is None or len(out) == ndim else None


def _storage_ranges(folder: Path, metadata: Metadata, checksums) -> dict[Any, tuple[str, int, int]]:
    """{storage index: (file, offset, length)} of every stored item, checked to lie inside its file (a file its
    checksum record gives another size is named as such first) without overlapping another."""
    where = f"{folder / METADATA_NAME}"
    file_sizes: dict[str, int] = {}
    ranges: dict[Any, tuple[str, int, int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise CheckpointFormatError(f"{where}: data file name {name!r} is not a plain file name in the "
                                        "checkpoint folder")
        if _sizes((offset, length)) is None:
            raise CheckpointFormatError(f"{where}: item {getattr(index, 'fqn', index)!r} has byte range "
                                        f"{offset!r}+{length!r}; the file is damaged or hostile")
        if name not in file_sizes:
            problem = size_problem(folder / name, checksums[name]) if checksums and name in checksums else None
            if problem or not (folder / name).is_file():
                raise DamagedFileError(folder, name, problem or "is missing")
            file_sizes[name] = (folder / name).stat().st_size
        if offset + length > file_sizes[name]:
            raise DamagedFileError(folder, name, f"is {file_sizes[name]} bytes, but {METADATA_NAME} places "
                                                 f"'{index.fqn}' at bytes {offset}..{offset + length} (truncated?)")
        ranges[index] = (name, offset, length)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in ranges.values():
        by_file.setdefault(name, []).append((offset, offset + length))
    for name, spans in by_file.items():
        spans.sort()
        if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
            raise CheckpointFormatError(f"{where}: two stored items overlap in {name}; the file is damaged or "
                                        "hostile")
    return ranges


def _check_sizes(folder: Path, metadata: Metadata, checksums=None) -> None:
    """Every tensor's global size against what its data files hold, before anything is allocated from it: its
    chunks lie inside it, each fits its byte range (``_storage_ranges``), and together they hold at least its
    elements. So no tensor read from this checkpoint is larger than its files (a ``DamagedFileError`` on
    ``.metadata`` otherwise, naming the tensor)."""
    ranges = _storage_ranges(folder, metadata, checksums)
    for key, md in (metadata.state_dict_metadata or {}).items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype = getattr(md.properties, "dtype", None)
        size = _sizes(md.size)
        if not isinstance(dtype, torch.dtype) or size is None:
            raise DamagedFileError(folder, METADATA_NAME, f"describes tensor '{key}' with size {md.size!r} and "
                                                          f"dtype {dtype!r}; the file is damaged or hostile")
        element = torch.empty((), dtype=dtype).element_size()
        held = 0
        for chunk in md.chunks or []:
            offsets, sizes = _sizes(chunk.offsets, len(size)), _sizes(chunk.sizes, len(size))
            if offsets is None or sizes is None or any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise DamagedFileError(folder, METADATA_NAME, f"places a chunk of tensor '{key}' (offsets "
                                                              f"{chunk.offsets!r}, sizes {chunk.sizes!r}) outside its "
                                                              f"size {size}; the file is damaged or hostile")
            stored = ranges.get(MetadataIndex(key, offsets))
            if stored is None or _volume(sizes) * element > stored[2]:
                raise DamagedFileError(folder, METADATA_NAME, f"claims a chunk of tensor '{key}' of sizes {sizes} "
                                                              f"({_volume(sizes) * element} bytes), but "
                                                              + ("stores none" if stored is None else
                                                                 f"stores {stored[2]} bytes for it in {stored[0]}")
                                                              + "; the file is damaged or hostile")
            held += _volume(sizes)
        if _volume(size) > held:
            raise DamagedFileError(folder, METADATA_NAME, f"claims tensor '{key}' of size {size} ({_volume(size)} "
                                                          f"elements), but its stored chunks hold {held}; the file "
                                                          "is damaged or hostile")


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
