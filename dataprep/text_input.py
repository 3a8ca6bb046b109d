"""Finding the inputs (JSONL, Parquet, ``datasets.save_to_disk`` folders) and streaming JSONL as blocks of whole
lines (plain, ``.gz``, ``.zst``); Parquet/Arrow files stream through ``text_tables`` (:func:`stream_inputs`).

The reader never holds a whole file: it decompresses in small pieces and hands out ~``block_bytes`` of
complete lines at a time, each block tagged with its file and first line number, so workers can report
``file:line`` for any record. The raw on-disk bytes are hashed as they stream past (SHA-256 for the
manifest, no second pass). A compressed file that ends early (cut-short gzip/zstd) is not silently
shortened: the reader yields what decoded cleanly and then a :class:`Truncated` marker naming the line.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dataprep.errors import PrepError
from dataprep.text_tables import ARROW_SUFFIXES, PARQUET_SUFFIXES, TableBlock, TableFailure, count_rows, \
    hf_dataset_files, input_kind, table_blocks

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
NOT_JSONL = "not a .jsonl/.json[.gz|.zst]/.parquet/.arrow name"  # names are matched case-sensitively: c.JSONL is skipped
_PIECE = 1 << 17  # compressed bytes fed to a decompressor at a time: keeps each output piece small


@dataclass
class InputFile:
    path: Path
    size: int
    sha256: str = ""
    records: int = 0  # non-blank lines (records) or table rows, counted by the caller
    bytes_read: int = 0  # uncompressed bytes (tables: bytes of the key columns' values)
    kind: str = "jsonl"  # jsonl | parquet | arrow (text_tables.input_kind)


@dataclass
class Block:
    """``data`` holds complete lines (the last one may lack its newline at end of file)."""

    file_index: int
    first_line: int  # 1-based line number of the first line in data
    data: bytes


@dataclass
class Truncated:
    """The file could not be read past ``line`` (a table: 0-based ``line`` = row, in ``row_group``); ``partial``
    holds the bytes of the cut line, if any. ``rows``: the records this stands for -- 1 where reading stopped
    (how many more the file held is unknown), a corrupt Parquet row group's lost rows where reading went on."""

    file_index: int
    line: int
    reason: str
    partial: bytes = field(default=b"")
    row_group: int | None = None
    rows: int = 1
    code: str = "truncated_file"  # the rejects log's code


def _is_input(name: str) -> bool:
    return name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES)


@dataclass
class Skipped:
    """A file a folder or glob input turned up but that is not read, and why (reported in the summary)."""

    path: Path
    reason: str  # NOT_JSONL | "dangling symlink" | "symlinked folder, not followed" | "this run's output" | ...


def expand_inputs(patterns: list[str]) -> list[InputFile]:
    """Files, globs and folders (searched recursively for inputs) -> a sorted, de-duplicated list."""
    return find_inputs(patterns)[0]


def _walk(folder: Path, exclude: set[Path], skipped: list[Skipped]) -> list[Path]:
    """Input files below ``folder`` in order: JSONL/Parquet/Arrow names sorted, a ``save_to_disk`` folder's
    shards in its own order (its json files are metadata, not records); everything else goes to ``skipped``
    with a reason."""
    groups: list[list[Path]] = []  # sorted by their first path; a dataset's shards stay in their order
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        shards = hf_dataset_files(Path(dirpath))
        if shards is not None:
            groups.append(shards)
            dirnames.clear()
            continue
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                skipped.append(Skipped(Path(dirpath, d), "symlinked folder, not followed"))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if path.resolve() in exclude:
                skipped.append(Skipped(path, "this run's output"))
            elif not _is_input(name):
                skipped.append(Skipped(path, NOT_JSONL))
            elif not path.is_file():
                skipped.append(Skipped(path, "dangling symlink" if path.is_symlink() else "not a regular file"))
            else:
                groups.append([path])
    return [p for group in sorted(groups, key=lambda g: g[0]) for p in group]


def find_inputs(patterns: list[str], exclude: set[Path] = frozenset()) -> tuple[list[InputFile], list[Skipped]]:
    """Files, globs and folders (searched recursively for inputs) -> a de-duplicated list in reading order, and
    what folders and globs turned up but is not read. ``exclude``: resolved paths of the run's own outputs,
    never read (named explicitly, they are an error: the run would read what it is about to replace)."""
    found: list[Path] = []
    skipped: list[Skipped] = []
    for pattern in patterns:
        magic = glob.has_magic(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if magic else [pattern]
        if not matches:
            raise PrepError(f"--input {pattern!r} matches no file")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                inner = hf_dataset_files(path)
                inner = inner if inner is not None else _walk(path, exclude, skipped)
                if not inner:
                    raise PrepError(f"--input folder {path} holds no .jsonl/.jsonl.gz/.jsonl.zst/.parquet/.arrow "
                                    "file and no datasets save_to_disk folder")
                found.extend(inner)
            elif path.resolve() in exclude:
                if not magic:
                    raise PrepError(f"--input {path} is an output of this run (same --output-prefix); "
                                    "it would be replaced while it is read. Give the input another name")
                skipped.append(Skipped(path, "this run's output"))
            elif path.is_file():
                found.append(path)
            elif magic and path.is_symlink():
                skipped.append(Skipped(path, "dangling symlink"))
            else:
                raise PrepError(f"--input {path} not found")
    if not found:
        raise PrepError(f"--input {' '.join(patterns)}: no input file to read (skipped: "
                        f"{describe_skipped(skipped)})")
    seen: set[Path] = set()
    files = []
    for path in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            files.append(InputFile(path=path, size=path.stat().st_size, kind=input_kind(path.name)))
    return files, skipped


def describe_skipped(skipped: list[Skipped], examples: int = 3) -> str:
    """'2 not a .jsonl/.json[.gz|.zst] name (d/c.JSONL, d/notes.txt); 1 dangling symlink (d/gone.jsonl)'."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(str(s.path))
    parts = []
    for reason, paths in by_reason.items():
        shown = ", ".join(paths[:examples]) + (f", ... {len(paths) - examples} more" if len(paths) > examples else "")
        parts.append(f"{len(paths)} {reason} ({shown})")
    return "; ".join(parts) or "nothing"


class _HashingReader:
    """File object wrapper that hashes and counts every byte read from disk."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.position = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha256.update(data)
        self.position += len(data)
        return data

    def readinto(self, b) -> int:  # used by gzip's buffered reads
        n = self._f.readinto(b)
        self.sha256.update(memoryview(b)[:n])
        self.position += n
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


def _plain_pieces(raw: _HashingReader, size: int) -> Iterator[bytes]:
    while piece := raw.read(size):
        yield piece


def _gzip_pieces(raw: _HashingReader, size: int) -> Iterator[bytes]:
    gz = gzip.GzipFile(fileobj=raw, mode="rb")
    # read1: one decompression step per call, so an error never swallows bytes already decoded
    while piece := gz.read1(size):
        yield piece


def _zstd_pieces(raw: _HashingReader) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, mid_frame = dctx.decompressobj(), False
    while chunk := raw.read(_PIECE):
        while chunk:
            mid_frame = True
            out = dobj.decompress(chunk)
            if out:
                yield out
            if dobj.eof:  # a frame ended; more frames may follow in the same file
                chunk, dobj, mid_frame = dobj.unused_data, dctx.decompressobj(), False
            else:
                chunk = b""
    if mid_frame:
        raise EOFError("zstd stream ended in the middle of a frame")


def _pieces_for(path: Path, raw: _HashingReader, size: int) -> Iterator[bytes]:
    name = path.name
    if name.endswith(".gz"):
        return _gzip_pieces(raw, size)
    if name.endswith((".zst", ".zstd")):
        return _zstd_pieces(raw)
    return _plain_pieces(raw, size)


def _decode_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    return tuple(errors)


def stream_blocks(files: list[InputFile], block_bytes: int = 1 << 20,
                  on_progress=None) -> Iterator[Block | Truncated]:
    """Yield blocks of whole lines from every (JSONL) file in order; fill in each file's sha256/records/bytes.

    ``on_progress(disk_bytes_delta)`` is called as on-disk bytes are consumed (for a progress bar).
    """
    for index, entry in enumerate(files):
        yield from _jsonl_blocks(index, entry, block_bytes, on_progress)


def stream_inputs(files: list[InputFile], keys: tuple[str, ...], block_bytes: int = 1 << 20,
                  on_progress=None) -> Iterator[Block | TableBlock | Truncated]:
    """Every file's blocks in input order: JSONL as :class:`Block` of whole lines, Parquet/Arrow as
    ``text_tables.TableBlock`` of the ``keys`` columns; a file that cannot be read on ends in a
    :class:`Truncated`. Fills in each file's sha256 and bytes; ``on_progress`` as for :func:`stream_blocks`."""
    for index, entry in enumerate(files):
        if entry.kind == "jsonl":
            yield from _jsonl_blocks(index, entry, block_bytes, on_progress)
        else:
            yield from _table_blocks(index, entry, keys, block_bytes, on_progress)


def _table_blocks(index: int, entry: InputFile, keys, block_bytes: int, on_progress) -> Iterator:
    total = count_rows(entry.path, entry.kind) if on_progress is not None else None
    reported = 0

    def on_rows(rows: int) -> None:  # progress in on-disk bytes, by the share of rows done
        nonlocal reported
        if on_progress is not None and total:
            done = entry.size * min(rows, total) // total
            on_progress(done - reported)
            reported = done

    for item in table_blocks(entry.path, entry.kind, index, keys, block_bytes, on_rows):
        if isinstance(item, TableFailure):  # after a final one (rows None) table_blocks yields nothing more
            yield (Truncated(index, item.row, item.reason, b"", item.row_group) if item.rows is None else
                   Truncated(index, item.row, item.reason, b"", item.row_group, item.rows, "corrupt_row_group"))
            continue
        entry.bytes_read += item.text_bytes
        yield item
    entry.sha256 = _sha256_of(entry.path)  # a second read: Parquet is read by row group, not front to back
    if on_progress is not None and entry.size != reported:
        on_progress(entry.size - reported)


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        raise PrepError(f"{path}: cannot read ({exc.strerror})") from None
    return h.hexdigest()


def _jsonl_blocks(index: int, entry: InputFile, block_bytes: int, on_progress) -> Iterator[Block | Truncated]:
    decode_errors = _decode_errors()
    try:
        f = open(entry.path, "rb")
    except OSError as exc:
        raise PrepError(f"{entry.path}: cannot open ({exc.strerror})") from None
    raw = _HashingReader(f)
    line = 1
    carry: list[bytes] = []  # pieces of a line not yet ended (a list: long lines stay linear)
    pending: list[bytes] = []
    pending_size = 0
    reported = 0
    try:
        pieces = _pieces_for(entry.path, raw, min(block_bytes, 1 << 20))
        while True:
            try:
                piece = next(pieces, None)
            except decode_errors as exc:
                if pending:
                    data = b"".join(pending)
                    yield Block(index, line, data)
                    line += data.count(b"\n")
                yield Truncated(index, line, f"file cut short or corrupt ({type(exc).__name__}: {exc}); "
                                "nothing after this line could be read", b"".join(carry))
                break
            if on_progress is not None and raw.position != reported:
                on_progress(raw.position - reported)
                reported = raw.position
            if piece is None:
                if carry:
                    pending.append(b"".join(carry))
                if pending:
                    yield Block(index, line, b"".join(pending))
                break
            entry.bytes_read += len(piece)
            cut = piece.rfind(b"\n")
            if cut < 0:
                carry.append(piece)  # one very long line: keep gathering
                continue
            pending.append(b"".join(carry) + piece[:cut + 1])
            pending_size += len(pending[-1])
            carry = [piece[cut + 1:]] if cut + 1 < len(piece) else []
            if pending_size >= block_bytes:
                data = b"".join(pending)
                yield Block(index, line, data)
                line += data.count(b"\n")
                pending, pending_size = [], 0
        # drain the rest of the raw file so the checksum covers every byte on disk
        while raw.read(1 << 20):
            pass
    finally:
        f.close()
    entry.sha256 = raw.sha256.hexdigest()
    if on_progress is not None and raw.position != reported:
        on_progress(raw.position - reported)


def split_lines(data: bytes) -> list[bytes]:
    """The lines of a block, without their newlines (a trailing newline does not make an extra line)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines
