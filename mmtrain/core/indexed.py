"""Indexed token datasets (``PREFIX.bin`` + ``PREFIX.idx``): the one place that knows the byte format.

The format is Megatron-Core's ``MMIDIDX`` index, byte for byte, so Megatron's ``IndexedDataset`` reads what we
write and we read what it writes::

    .idx  b"MMIDIDX\\x00\\x00"             9-byte magic
          <Q version (1)  <B dtype code  <Q sequence count  <Q document count
          int32[sequence count]   sequence lengths (tokens)
          int64[sequence count]   byte offset of each sequence in .bin
          int64[document count]   document boundaries as sequence indices: 0, ..., sequence count
    .bin  the tokens of all sequences back to back, in the dtype named by the code

We write one sequence per document, so document ``i`` is sequence ``i`` and the document indices are
``0, 1, ..., N``. The writer streams: tokens go straight to a temporary ``.bin``, lengths to a temporary
side file, and the ``.idx`` is assembled in chunks at the end, so memory stays flat however large the data.
Nothing appears under the final names until :meth:`IndexedDatasetWriter.commit`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from mmtrain.utils.atomic import file_mode, fsync_dir

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

# Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

# Megatron picks uint16 below this cardinality; we apply the same bound to the largest id.
UINT16_LIMIT = 65500
_CHUNK_ITEMS = 1 << 20  # items per chunk when assembling the .idx


class IndexedFormatError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated or inconsistent. The message names the file."""


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def token_dtype_for(max_token_id: int) -> np.dtype:
    """uint16 when every id (added tokens included) fits below 65500, else int32 -- Megatron's rule."""
    return np.dtype(np.uint16) if max_token_id < UINT16_LIMIT else np.dtype(np.int32)


def default_file_mode() -> int:
    """0o666 minus the umask: what a plain open() would give (mkstemp makes temporaries 0o600)."""
    return file_mode()  # read without os.umask's set-and-restore, which races with other threads' files


def _temp_next_to(path: Path, tag: str) -> tuple[int, Path]:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{tag}.tmp", dir=path.parent)
    return fd, Path(tmp)


class IndexedDatasetWriter:
    """Streams documents into ``PREFIX.bin``/``PREFIX.idx`` through temporaries.

    ``add`` appends documents; ``finish`` writes the index and fsyncs (still under temporary names);
    ``commit`` renames both into place; ``abort`` removes the temporaries. Use as a context manager to get
    ``abort`` on any error. SHA-256 of both files is computed while writing (no second pass).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = bin_path(prefix), idx_path(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.documents = 0
        self.tokens = 0
        self.bin_sha256 = hashlib.sha256()
        self.idx_sha256 = hashlib.sha256()
        self._tmp: list[Path] = []
        fd, self._bin_tmp = _temp_next_to(self.bin_path, "bin")
        self._bin = os.fdopen(fd, "wb", buffering=0)
        self._tmp.append(self._bin_tmp)
        fd, self._len_tmp = _temp_next_to(self.idx_path, "lengths")
        self._lengths = os.fdopen(fd, "wb", buffering=1 << 20)
        self._tmp.append(self._len_tmp)
        self._idx_tmp: Path | None = None
        self.finished = False

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose tokens lie back to back in ``tokens``."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given")
        data = memoryview(tokens).cast("B")
        self.bin_sha256.update(data)
        while data:  # raw (unbuffered) writes may be short
            data = data[self._bin.write(data):]
        self._lengths.write(lengths.tobytes())
        self.documents += lengths.size
        self.tokens += tokens.size

    def _write_idx(self, f) -> None:
        def out(b: bytes | memoryview) -> None:
            self.idx_sha256.update(b)
            f.write(b)

        n = self.documents
        out(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_BY_DTYPE[self.dtype])
            + struct.pack("<Q", n) + struct.pack("<Q", n + 1))
        lengths = np.memmap(self._len_tmp, dtype=np.int32, mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
        for start in range(0, n, _CHUNK_ITEMS):
            out(memoryview(np.ascontiguousarray(lengths[start:start + _CHUNK_ITEMS])).cast("B"))
        offset = 0
        itemsize = self.dtype.itemsize
        for start in range(0, n, _CHUNK_ITEMS):
            chunk = lengths[start:start + _CHUNK_ITEMS].astype(np.int64) * itemsize
            ends = np.cumsum(chunk) + offset
            pointers = ends - chunk
            out(memoryview(pointers).cast("B"))
            offset = int(ends[-1])
        for start in range(0, n + 1, _CHUNK_ITEMS):
            out(memoryview(np.arange(start, min(n + 1, start + _CHUNK_ITEMS), dtype=np.int64)).cast("B"))
        del lengths

    def finish(self) -> None:
        """Write the index and fsync both files, still under temporary names."""
        self._lengths.close()
        os.fsync(self._bin.fileno())
        self._bin.close()
        fd, self._idx_tmp = _temp_next_to(self.idx_path, "idx")
        self._tmp.append(self._idx_tmp)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            self._write_idx(f)
            f.flush()
            os.fsync(f.fileno())
        self.finished = True

    def commit(self) -> None:
        """Rename the finished temporaries to ``PREFIX.bin`` and ``PREFIX.idx``."""
        if not self.finished:
            self.finish()
        mode = default_file_mode()
        os.chmod(self._bin_tmp, mode)
        os.chmod(self._idx_tmp, mode)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._len_tmp)
        self._tmp.clear()
        fsync_dir(self.bin_path.parent)

    def abort(self) -> None:
        for f in (self._bin, self._lengths):
            with contextlib.suppress(Exception):
                f.close()
        for tmp in self._tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._tmp.clear()

    def summary(self) -> dict:
        return {"bin": self.bin_path.name, "idx": self.idx_path.name, "documents": self.documents,
                "tokens": self.tokens, "bin_size": self.tokens * self.dtype.itemsize,
                "bin_sha256": self.bin_sha256.hexdigest(), "idx_size": self.idx_path.stat().st_size
                if self.idx_path.exists() else None, "idx_sha256": self.idx_sha256.hexdigest()}


def read_index_header(path: str | os.PathLike) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document count) from an ``.idx``, with file-naming errors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
    except FileNotFoundError:
        raise IndexedFormatError(f"{path}: index file not found") from None
    if len(head) < HEADER_SIZE:
        raise IndexedFormatError(f"{path}: {len(head)} bytes, shorter than the {HEADER_SIZE}-byte header")
    if head[:9] != MAGIC:
        raise IndexedFormatError(f"{path}: not an MMIDIDX index (magic is {head[:9]!r})")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise IndexedFormatError(f"{path}: index version {version}, only version {VERSION} is supported")
    code = head[17]
    if code not in DTYPE_BY_CODE:
        raise IndexedFormatError(f"{path}: unknown dtype code {code}")
    sequences, documents = struct.unpack_from("<QQ", head, 18)
    return DTYPE_BY_CODE[code], sequences, documents


class IndexedDataset:
    """Memory-mapped, zero-copy reader of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    ``ds[i]`` is a read-only numpy view of sequence ``i``. Opening checks that the index is exactly as long
    as its counts say and that ``.bin`` holds every byte the index points at, so a truncated file is a
    clear error here rather than garbage later.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = Path(prefix)
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        self.dtype, self.sequence_count, self.document_count = read_index_header(self.idx_path)
        n = self.sequence_count
        expected = HEADER_SIZE + n * (4 + 8) + self.document_count * 8
        actual = self.idx_path.stat().st_size
        if actual < expected:
            raise IndexedFormatError(f"{self.idx_path}: {actual} bytes but its counts need {expected} "
                                     "(truncated index; re-run the prep)")
        self._idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.lengths = np.frombuffer(self._idx, np.int32, n, HEADER_SIZE)
        self.pointers = np.frombuffer(self._idx, np.int64, n, HEADER_SIZE + 4 * n)
        self.document_indices = np.frombuffer(self._idx, np.int64, self.document_count, HEADER_SIZE + 12 * n)
        if not self.bin_path.exists():
            raise IndexedFormatError(f"{self.bin_path}: data file not found (the .idx exists)")
        self.bin_size = self.bin_path.stat().st_size
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if n else 0
        if self.bin_size < end:
            raise IndexedFormatError(f"{self.bin_path}: {self.bin_size} bytes but the index points up to byte "
                                     f"{end} (truncated data file; re-run the prep)")
        self.data_end = end
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if self.bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return self.sequence_count

    @property
    def num_documents(self) -> int:
        return max(self.document_count - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.sequence_count <= i < self.sequence_count:
            raise IndexError(f"sequence {i} out of range for {self.sequence_count} sequences in {self.prefix}")
        i %= self.sequence_count
        return np.frombuffer(self._bin, self.dtype, int(self.lengths[i]), int(self.pointers[i]))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``i`` (what GPT sample building needs)."""
        seq = self[i]
        return seq[offset:] if length is None else seq[offset:offset + length]

    def tokens_of_range(self, start: int, stop: int) -> np.ndarray:
        """All tokens of sequences ``start..stop-1`` as one contiguous view (for merge and bulk reads)."""
        if start >= stop:
            return np.zeros(0, self.dtype)
        count = int(self.lengths[start:stop].sum(dtype=np.int64))
        return np.frombuffer(self._bin, self.dtype, count, int(self.pointers[start]))
