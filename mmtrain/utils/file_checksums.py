"""Checksums of written files: a 64-bit XXH3 hash of every byte, computed while the bytes are written, and its check.

A checksum record is ``{"algorithm": "xxh3_64", "files": {name: {"xxh3_64": "0x0123456789abcdef", "bytes": N}}}``
(JSON), names relative to the folder holding the files. XXH3 (``xxhash``) because hashing must cost a checkpoint
save next to nothing: measured on the 2-core dev machine it hashes ~4-13 GB/s a core and releases the GIL, where
the standard library's fastest, ``zlib.crc32``, does 1.3 GB/s (SHA-1 0.7, BLAKE2b 0.45), which made saves 26%
slower. ``google-crc32c`` is as fast but accepts only read-only buffers, i.e. a copy of every tensor. XXH3 is no
cryptographic hash: it guards against corruption, not against someone who also rewrites the record.
``HashingFile`` can hash in a thread of its own while the writer goes on writing and syncing.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"
_BORROW_MIN = 1 << 20
_READ_BLOCK = 16 << 20


def hash_entry(digest: int, size: int) -> dict[str, Any]:
    return {ALGORITHM: f"0x{digest:016x}", "bytes": size}


def entry_of_bytes(data: bytes | memoryview) -> dict[str, Any]:
    view = memoryview(data).cast("B")
    return hash_entry(xxhash.xxh3_64_intdigest(view), view.nbytes)


class HashingFile:
    """A binary file object that passes writes to ``raw`` and keeps the XXH3 hash and size of what went through.

    ``background``: hash in a thread of this file's own, in write order, so that hashing overlaps the writes
    and the final fsync instead of adding to them. A buffer of at least
    ``_BORROW_MIN`` bytes is hashed in place after ``write`` returned: DCP's writer hands over tensor storage
    that it keeps alive until the file is closed (``entry()`` waits for the hashes). Were that ever not so,
    the record would not match and loading would stop on the file; it could not let damage through. Smaller
    buffers (zip headers written from short-lived memory) are copied into one pending block, hashed when it
    reaches ``_BORROW_MIN``, before the next large buffer, or at ``entry()``: one task per block, not per
    write (``torch.save`` writes ~40 small records per tensor, and a thread-pool task each made a checkpoint
    of many small tensors spend more time handing out work than hashing)."""

    def __init__(self, raw, background: bool = False) -> None:
        self.raw = raw
        self._hash = xxhash.xxh3_64()
        self.size = 0
        self._hasher = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmtrain-hash") if background
                        else None)
        self._pending: list[concurrent.futures.Future] = []
        self._small = bytearray()  # copies of the small writes since the last hand-over to the hasher

    def _update(self, view) -> None:
        self._hash.update(view)

    def _hand_over_small(self) -> None:
        if self._small:
            self._pending.append(self._hasher.submit(self._update, self._small))
            self._small = bytearray()  # a new block: the hasher may still be reading the old one

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._hasher is None:
            self._update(view)
        elif view.nbytes >= _BORROW_MIN:
            self._hand_over_small()  # first: the hash covers the bytes in write order
            self._pending.append(self._hasher.submit(self._update, view))
        else:
            self._small += view
            if len(self._small) >= _BORROW_MIN:
                self._hand_over_small()
        written = self.raw.write(view)
        self.size += view.nbytes
        return view.nbytes if written is None else written

    def entry(self) -> dict[str, Any]:
        """The record of everything written (waits for the hashes still running)."""
        if self._hasher is not None:
            self._hand_over_small()
            self._hasher.shutdown(wait=True)
            for f in self._pending:
                f.result()  # re-raise a failed hash
            self._hasher, self._pending = None, []
        return hash_entry(self._hash.intdigest(), self.size)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def writable(self) -> bool:
        return True


def entry_of_file(path: Path) -> dict[str, Any]:
    """The record (``hash_entry``) of the file at ``path`` as it is now."""
    digest, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
            size += len(block)
    return hash_entry(digest.intdigest(), size)


def size_problem(path: Path, expected: dict[str, Any]) -> str | None:
    """Why ``path`` cannot match its record ``expected`` without reading it (missing, another size), or None."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != expected.get("bytes"):
        return f"is {size} bytes, {expected.get('bytes')} when it was written (truncated or replaced?)"
    return None


def file_problem(path: Path, expected: dict[str, Any]) -> str | None:
    """Why ``path`` does not match its record ``expected`` (``hash_entry``), or None when it does."""
    problem = size_problem(path, expected)
    if problem:
        return problem
    if entry_of_file(path)[ALGORITHM] != expected.get(ALGORITHM):
        return "does not match its checksum (corrupt?)"
    return None


def record_text(files: dict[str, dict[str, Any]]) -> str:
    return json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1) + "\n"


def read_record(path: Path) -> dict[str, dict[str, Any]] | None:
    """The ``files`` of the checksum record at ``path``; None when there is none. ValueError (naming the file)
    when it is not a record this code wrote."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get(ALGORITHM), str) and isinstance(e.get("bytes"), int)
                for e in files.values()):
            raise ValueError(f"algorithm {record.get('algorithm')!r} or its entries are not what this version writes")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable checksum record ({exc}); it is damaged or from another "
                         "tool") from None
    return files
