"""Parquet files and Hugging Face ``datasets.save_to_disk`` folders as `mmtrain-prep text` inputs.

Writing-process side: :func:`table_blocks` streams one file's ``--json-keys`` columns (and nothing else) as
:class:`TableBlock`s of about ``block_bytes`` of text -- Parquet one row group at a time, in batches; Arrow IPC
(what ``save_to_disk`` writes) record batch by record batch from a memory map -- so memory stays flat whatever
the file's size. Each block's arrays are freshly concatenated, so pickling one to a worker sends only its own
rows. Worker side: :func:`column_texts` turns a column into Python strings plus per-row problems (null, not a
string, invalid UTF-8 in a binary column); text_encode turns those into rejects.

Rows are numbered from 0 within their file, as pyarrow, pandas and ``datasets`` index them; a Parquet reject
also names its row group. ``datasets`` itself is never imported: its folder layout (``state.json`` listing the
``.arrow`` shards in order, ``dataset_info.json``) is read here, file names confined to the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dataprep.errors import PrepError

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow",)
HF_STATE = "state.json"  # written by datasets.Dataset.save_to_disk next to dataset_info.json
HF_INFO = "dataset_info.json"
HF_DICT = "dataset_dict.json"  # written by datasets.DatasetDict.save_to_disk above one folder per split
_MAX_BATCH_ROWS = 8192  # Parquet rows decoded at a time (fewer when the metadata says rows are large)


@dataclass
class TableBlock:
    """Rows ``first_row .. first_row + num_rows - 1`` of one file; every row in one Parquet row group."""

    file_index: int
    row_group: int | None  # Parquet row group; None for Arrow files
    first_row: int  # 0-based row in the file
    num_rows: int
    columns: dict[str, Any]  # key -> contiguous pyarrow Array; keys the file lacks are absent
    text_bytes: int  # bytes of the key columns' values


def input_kind(name: str) -> str:
    """'parquet', 'arrow' or 'jsonl' (any other name is read as JSONL, as before)."""
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    return "jsonl"


def describe_row(kind: str, row: int, row_group: int | None) -> tuple[dict, str]:
    """The rejects log's location fields and the text form ('row group 2, row 4100') of one table row."""
    if kind == "parquet" and row_group is not None:
        return {"row_group": row_group, "row": row}, f"row group {row_group}, row {row}"
    return {"row": row}, f"row {row}"


def _dataset_dict_splits(folder: Path) -> list[str]:
    if not (folder / HF_DICT).is_file():
        return []
    try:
        splits = json.loads((folder / HF_DICT).read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(splits, list):
        return []
    return [s for s in splits if isinstance(s, str) and (folder / s / HF_STATE).is_file()]


def hf_dataset_files(folder: Path) -> list[Path] | None:
    """The ``.arrow`` shards of a ``save_to_disk`` folder (``state.json`` + ``dataset_info.json``) in the dataset's
    row order, or None when ``folder`` is not one. A DatasetDict folder (``dataset_dict.json`` listing splits that
    are such folders) is an error naming its splits: reading them all in one run is rarely meant."""
    splits = _dataset_dict_splits(folder)
    if splits:
        raise PrepError(f"--input {folder} is a datasets DatasetDict (splits: {', '.join(splits)}); name the "
                        f"split to read, e.g. --input {folder / splits[0]}")
    state_path = folder / HF_STATE
    if not (state_path.is_file() and (folder / HF_INFO).is_file()):
        return None  # both files are what save_to_disk writes; one alone may be anyone's JSON
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        entries = state["_data_files"]
        names = [e["filename"] for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrepError(f"{state_path}: not a datasets save_to_disk state file ({type(exc).__name__}: {exc}); "
                        "it must list the Arrow shards under \"_data_files\"") from None
    if not isinstance(entries, list) or not names:
        raise PrepError(f"{state_path}: \"_data_files\" lists no Arrow file")
    root = folder.resolve()
    files = []
    for name in names:
        # a hostile state.json must not make us read outside its folder
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise PrepError(f"{state_path}: data file name {name!r} is not a plain file name in the folder")
        path = folder / name
        if path.resolve().parent != root:
            raise PrepError(f"{state_path}: data file {name!r} leads outside {folder}")
        if not path.is_file():
            raise PrepError(f"{state_path}: data file {path} not found; the dataset folder is incomplete")
        files.append(path)
    return files


def _arrow_error_types() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowException, OSError, ValueError)


def _contiguous(chunks: list) -> Any:
    """One array holding only these rows (a slice would pickle its parent's whole buffers)."""
    import pyarrow as pa

    return pa.concat_arrays(chunks)


def _value_bytes(array) -> int:
    """Bytes of the values (offsets of a string/binary array; no pyarrow.compute, whose import takes ~1 s)."""
    import pyarrow as pa

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    t = array.type
    if (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)) and len(array):
        wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        offsets = np.frombuffer(array.buffers()[1], np.int64 if wide else np.int32)
        return int(offsets[array.offset + len(array)] - offsets[array.offset])
    return int(array.nbytes)


def _block(file_index: int, row_group: int | None, first_row: int, batches: list, keys) -> TableBlock:
    columns = {}
    for k in keys:
        parts = [b.column(k) for b in batches if k in b.schema.names]
        if parts:
            columns[k] = _contiguous(parts)
    rows = sum(b.num_rows for b in batches)
    return TableBlock(file_index, row_group, first_row, rows, columns,
                      sum(_value_bytes(a) for a in columns.values()))


def _grouped(batches: Iterator, keys, block_bytes: int) -> Iterator[list]:
    """Consecutive record batches gathered to about ``block_bytes`` of key-column data."""
    group, size = [], 0
    for b in batches:
        if b.num_rows == 0:
            continue
        group.append(b)
        size += sum(b.column(k).nbytes for k in keys if k in b.schema.names)
        if size >= block_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


@dataclass
class TableFailure:
    """Rows from ``row`` on that could not be read. ``rows`` is None when the file could not be read from there on
    (cut short, corrupt, not a Parquet/Arrow file: reading stops); else the number of rows lost -- the rest of a
    corrupt Parquet row group, whose count the footer gives -- and reading goes on with the next row group."""

    row: int
    row_group: int | None
    reason: str
    rows: int | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _parquet_blocks(path: Path, index: int, keys, block_bytes: int, on_rows) -> Iterator[TableBlock | TableFailure]:
    import pyarrow.parquet as pq

    errors = _arrow_error_types()
    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except errors as exc:
        yield TableFailure(0, None, f"not a readable Parquet file ({_first_line(exc)}); no row could be read")
        return
    present = [k for k in keys if k in pf.schema_arrow.names]
    row = 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        if rg.num_rows == 0:
            continue
        group_start = row
        size = sum(rg.column(c).total_uncompressed_size for c in range(rg.num_columns)
                   if rg.column(c).path_in_schema.split(".")[0] in present)
        per_row = max(size / rg.num_rows, 1.0)
        batch_rows = int(min(_MAX_BATCH_ROWS, max(1, block_bytes // per_row)))
        try:
            if present:
                batches = pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=present, use_threads=False)
                for group in _grouped(batches, present, block_bytes):
                    block = _block(index, g, row, group, present)
                    row += block.num_rows
                    on_rows(row)
                    yield block
            else:  # no key column at all: the rows still count, each one a reject
                for start in range(0, rg.num_rows, batch_rows):
                    n = min(batch_rows, rg.num_rows - start)
                    yield TableBlock(index, g, row, n, {}, 0)
                    row += n
                    on_rows(row)
        except errors as exc:
            # Row groups are independent and the footer (read above) gives each one's row count: count the rest
            # of this one as lost and go on with the next, so the file's rows are all accounted for.
            lost = max(group_start + rg.num_rows - row, 1)
            yield TableFailure(row, g, f"row group {g} is corrupt ({_first_line(exc)}): its rows {row} to "
                                       f"{row + lost - 1} ({lost:,}) could not be read; reading went on with the "
                                       "next row group", rows=lost)
            row += lost
            on_rows(row)


def _arrow_blocks(path: Path, index: int, keys, block_bytes: int, on_rows) -> Iterator[TableBlock | TableFailure]:
    import pyarrow as pa

    errors = _arrow_error_types()
    row = 0
    try:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)  # what datasets writes
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)  # the Arrow IPC file format (Feather v2)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            for group in _grouped(batches, keys, block_bytes):
                block = _block(index, None, row, group, keys)
                row += block.num_rows
                on_rows(row)
                yield block
    except errors as exc:
        yield TableFailure(row, None, f"file cut short or corrupt ({_first_line(exc)}); nothing from row {row} "
                                      "on could be read")


def count_rows(path: Path, kind: str) -> int | None:
    """Rows of a Parquet file (its footer) or an Arrow file (its batch headers, memory-mapped: no data is read);
    None when unreadable. For the progress bar only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return pq.ParquetFile(path).metadata.num_rows
        with pa.memory_map(str(path)) as source:
            try:
                return sum(b.num_rows for b in pa.ipc.open_stream(source))
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except _arrow_error_types():
        return None


def preload() -> None:
    """Import pyarrow now, in the writing process, so forked workers share its pages instead of each importing
    it (~50 MB) when the first block arrives; a missing pyarrow is a one-line error before any work."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise PrepError("reading Parquet/Arrow inputs needs pyarrow: pip install pyarrow") from None


def table_blocks(path: Path, kind: str, index: int, keys, block_bytes: int,
                 on_rows=lambda rows: None) -> Iterator[TableBlock | TableFailure]:
    """Blocks of one Parquet or Arrow file in row order, with a TableFailure for each corrupt Parquet row group
    (``rows`` lost, reading goes on) and at most one final TableFailure (``rows`` None: reading stops there).
    ``on_rows(rows_done)`` follows the progress through the file."""
    preload()
    blocks = _parquet_blocks if kind == "parquet" else _arrow_blocks
    return blocks(path, index, tuple(keys), block_bytes, on_rows)


# --- worker side -------------------------------------------------------------------------------------------

def _excerpt_value(value, limit: int = 200) -> str:
    if isinstance(value, bytes):
        return value[:limit * 4].decode("utf-8", errors="backslashreplace")[:limit]
    return repr(value)[:limit]


def _kind_name(t) -> str:
    return str(t)


def column_texts(key: str, array) -> tuple[list, dict[int, tuple[str, str, str]]]:
    """(values, problems): values[i] is row i's text (anything where a problem is recorded); problems maps a
    row to (code, reason, excerpt) for a null, a non-string value or invalid UTF-8."""
    import pyarrow as pa

    t = array.type
    if pa.types.is_dictionary(t):
        array, t = array.dictionary_decode(), t.value_type
    n = len(array)
    problems: dict[int, tuple[str, str, str]] = {}
    if array.null_count:
        valid = array.buffers()[0]  # the validity bitmap (Array.is_null would import pyarrow.compute)
        bits = np.unpackbits(np.frombuffer(valid, np.uint8), bitorder="little")[array.offset:array.offset + n]
        for i in np.flatnonzero(bits == 0).tolist():
            problems[i] = ("null_value", f"column {key!r} is null in this row, not a string", "null")
    stringy = (pa.types.is_string(t) or pa.types.is_large_string(t)
               or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)))
    binary = (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
              or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(t)))
    if stringy:
        try:
            return array.to_pylist(), problems
        except UnicodeDecodeError:  # a writer that skipped Arrow's UTF-8 check: find the rows
            as_bytes = {"large_string": pa.large_binary(), "string_view": getattr(pa, "binary_view", pa.binary)()}
            array = array.view(as_bytes.get(str(t), pa.binary()))
            binary = True
    if binary:
        raw = array.to_pylist()
        values: list = [None] * n
        for i, b in enumerate(raw):
            if b is None:
                continue
            try:
                values[i] = b.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems[i] = ("invalid_utf8", f"column {key!r} holds invalid UTF-8 at byte {exc.start}; "
                                               "re-encode the text as UTF-8", _excerpt_value(b))
        return values, problems
    if pa.types.is_null(t):
        return [None] * n, problems
    values = array.to_pylist()
    for i, v in enumerate(values):
        if v is not None:
            problems[i] = ("not_a_string", f"column {key!r} holds {_kind_name(t)}, not a string", _excerpt_value(v))
    return values, problems


def table_texts(block: TableBlock, keys) -> tuple[dict[str, list[str]], list[int], dict[int, tuple[str, str, str]]]:
    """Texts per key of the usable rows, each one's index in the block, and the other rows' problem (the first
    key's, in --json-keys order)."""
    bad: dict[int, tuple[str, str, str]] = {}
    values: dict[str, list] = {}
    for k in keys:
        array = block.columns.get(k)
        if array is None:
            reason = f"no column {k!r} in this file; see --json-keys"
            for i in range(block.num_rows):
                bad.setdefault(i, ("missing_key", reason, ""))
            continue
        values[k], problems = column_texts(k, array)
        for i, p in problems.items():
            bad.setdefault(i, p)
    if not bad:
        return values, list(range(block.num_rows)), bad
    where = [i for i in range(block.num_rows) if i not in bad]
    return {k: [values[k][i] for i in where] if k in values else [] for k in keys}, where, dict(sorted(bad.items()))
