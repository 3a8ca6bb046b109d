"""Worker side of `mmtrain-prep text`: one block of JSONL lines (or of Parquet/Arrow rows) -> token arrays,
rejects and counts.

Per line the work is the unavoidable minimum in Python (UTF-8 check, ``json.loads``, key checks); the
tokenizer then encodes the whole block in one batch call (C++/Rust), and ids become one flat numpy array
per key plus an int32 length array. That keeps per-document Python overhead small and the result cheap
to send back to the writing process. Every non-blank line ends up in exactly one of: written, empty,
rejected (with its line number and reason). A table block's rows go the same way (``text_tables`` turns its
columns into strings); a reject's ``line`` is then its 0-based row in the file, and the block names the row group.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from dataprep.text_input import Block, split_lines
from dataprep.text_tables import TableBlock, table_texts
from mmtrain.core.tokenizer import Tokenizer, load_tokenizer

EXCERPT_CHARS = 200
_JSON_TYPE = {dict: "an object", list: "an array", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


@dataclass(frozen=True)
class EncodeOptions:
    tokenizer: str
    tokenizer_type: str | None
    eod_token: str | None
    add_special_tokens: bool
    json_keys: tuple[str, ...]
    append_eod: bool
    eod_id: int | None
    keep_empty: bool
    dtype: str
    threads: int = 1
    merge_file: str | None = None  # GPT-2 merges.txt (type gpt2-bpe)


@dataclass
class Reject:
    line: int
    reason: str
    excerpt: str
    code: str = "bad_record"  # stable category for summaries: malformed_json, missing_key, not_a_string, ...


@dataclass
class EncodedBlock:
    file_index: int
    first_line: int  # a table block: its first row (0-based)
    text_bytes: int
    row_group: int | None = None  # a Parquet block's row group
    records: int = 0  # non-blank lines (table rows)
    blank: int = 0
    empty: int = 0
    rejects: list[Reject] = field(default_factory=list)
    warnings: list[Reject] = field(default_factory=list)  # written records worth a look (sft: identical_pair)
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def written(self) -> int:
        return len(next(iter(self.lengths.values()))) if self.lengths else 0

    @property
    def token_count(self) -> int:
        return sum(int(t.size) for t in self.tokens.values())


def excerpt(raw: bytes) -> str:
    return raw[:EXCERPT_CHARS * 4].decode("utf-8", errors="backslashreplace")[:EXCERPT_CHARS]


def parse_records(lines: list[bytes], first_line: int, keys: tuple[str, ...], out: EncodedBlock):
    """Texts per key of the valid records, and each one's index in ``lines``; counts and rejects go to out."""
    texts: dict[str, list[str]] = {k: [] for k in keys}
    where: list[int] = []  # index into lines of each kept record
    for i, raw in enumerate(lines):
        if not raw.strip():
            out.blank += 1
            continue
        out.records += 1
        if i == 0 and first_line == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark at the start of a file is not part of the record
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            code, reason = "invalid_utf8", f"invalid UTF-8 at byte {exc.start} of the line; re-encode the file as UTF-8"
        except json.JSONDecodeError as exc:
            code, reason = "malformed_json", f"malformed JSON: {exc.msg} at column {exc.colno}"
        except RecursionError:
            code, reason = "malformed_json", "malformed JSON: nested too deeply to parse"
        except ValueError:  # Python's limit on digits in an int conversion
            code, reason = "malformed_json", (f"malformed JSON: an integer with more than "
                                              f"{sys.get_int_max_str_digits()} digits")
        else:
            problem = check_record(obj, keys)
            if problem is None:
                for k in keys:
                    texts[k].append(obj[k])
                where.append(i)
                continue
            code, reason = problem
        out.rejects.append(Reject(first_line + i, reason, excerpt(raw), code))
    return texts, where


def check_record(obj, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """None for a usable record, else (code, reason)."""
    if not isinstance(obj, dict):
        return "not_an_object", f"the line is {_JSON_TYPE.get(type(obj), type(obj).__name__)}, not a JSON object"
    for k in keys:
        if k not in obj:
            present = ", ".join(x[:40] for x in sorted(obj)[:8]) or "none"
            return "missing_key", f"missing key {k!r} (keys present: {present}); see --json-keys"
        if not isinstance(obj[k], str):
            kind = _JSON_TYPE.get(type(obj[k]), type(obj[k]).__name__)
            return "not_a_string", f"key {k!r} holds {kind}, not a string"
    return None


class BlockEncoder:
    """Holds the tokenizer (one per process) and turns blocks into :class:`EncodedBlock`."""

    def __init__(self, options: EncodeOptions, tokenizer: Tokenizer | None = None) -> None:
        self.options = options
        self.tokenizer = tokenizer or load_tokenizer(options.tokenizer, options.tokenizer_type,
                                                     eod_token=options.eod_token,
                                                     add_special_tokens=options.add_special_tokens,
                                                     merge_file=options.merge_file)
        self.tokenizer.set_threads(options.threads)
        self.dtype = np.dtype(options.dtype)

    def _encode_all(self, texts: dict[str, list[str]], where: list[int], line_of, excerpt_of,
                    out: EncodedBlock) -> dict[str, list[list[int]]]:
        """``line_of(i)`` / ``excerpt_of(i)``: a record's position and excerpt by its index in the block."""
        try:
            return {k: self.tokenizer.encode_batch(v) for k, v in texts.items()}
        except Exception:  # noqa: BLE001 - find the record(s) the tokenizer refuses, reject only those
            pass
        bad: dict[int, tuple[str, str]] = {}
        for j in range(len(where)):
            for k, v in texts.items():
                try:
                    v[j].encode("utf-8")
                except UnicodeEncodeError as exc:
                    bad[j] = ("lone_surrogate",
                              f"key {k!r} holds a lone surrogate (\\u{ord(v[j][exc.start]):04x} escape) at "
                              f"character {exc.start}: not valid Unicode; fix the JSON escape")
                    break
                try:
                    self.tokenizer.encode_batch([v[j]])
                except Exception as exc:  # noqa: BLE001
                    bad[j] = "tokenizer_error", f"tokenizer refused key {k!r}: {type(exc).__name__}: {exc}"[:300]
                    break
        for j, (code, reason) in bad.items():
            out.rejects.append(Reject(line_of(where[j]), reason, excerpt_of(where[j]), code))
        out.rejects.sort(key=lambda r: r.line)
        keep = [j for j in range(len(where)) if j not in bad]
        for k in texts:
            texts[k] = [texts[k][j] for j in keep]
        return {k: self.tokenizer.encode_batch(v) for k, v in texts.items()}

    def encode(self, block: Block | TableBlock) -> EncodedBlock:
        if isinstance(block, TableBlock):
            return self._encode_table(block)
        out = EncodedBlock(block.file_index, block.first_line, len(block.data))
        lines = split_lines(block.data)
        texts, where = parse_records(lines, block.first_line, self.options.json_keys, out)
        ids = (self._encode_all(texts, where, lambda i: block.first_line + i, lambda i: excerpt(lines[i]), out)
               if where else {})
        return self._finish(ids, out)

    def _encode_table(self, block: TableBlock) -> EncodedBlock:
        out = EncodedBlock(block.file_index, block.first_row, block.text_bytes, row_group=block.row_group,
                           records=block.num_rows)
        texts, where, bad = table_texts(block, self.options.json_keys)
        for i, (code, reason, value) in bad.items():
            out.rejects.append(Reject(block.first_row + i, reason, value, code))

        position: dict[int, int] = {}  # row in the block -> index in texts, built only if a row is refused

        def excerpt_of(i: int) -> str:
            if not position:
                position.update((row, j) for j, row in enumerate(where))
            return " | ".join(texts[k][position[i]][:EXCERPT_CHARS] for k in texts)[:EXCERPT_CHARS]

        ids = self._encode_all(texts, where, lambda i: block.first_row + i, excerpt_of, out) if where else {}
        return self._finish(ids, out)

    def _finish(self, ids: dict[str, list[list[int]]], out: EncodedBlock) -> EncodedBlock:
        """Token ids per key -> one flat array and the lengths per key; empty documents counted (and dropped)."""
        n = len(next(iter(ids.values()))) if ids else 0
        lengths = {k: np.fromiter(map(len, v), np.int64, count=n) for k, v in ids.items()}
        keep = None
        if n and not self.options.keep_empty:
            nonempty = np.zeros(n, bool)
            for ln in lengths.values():
                nonempty |= ln > 0
            out.empty = int(n - nonempty.sum())
            keep = nonempty if out.empty else None
        for k, v in ids.items():
            ln = lengths[k]
            flat = np.fromiter(chain.from_iterable(v), self.dtype, count=int(ln.sum()))
            if keep is not None:
                ln = ln[keep]  # dropped documents have no tokens, so flat is unchanged
            if self.options.append_eod:
                flat = np.insert(flat, np.cumsum(ln), np.asarray(self.options.eod_id, self.dtype))
                ln = ln + 1
            out.tokens[k] = flat
            out.lengths[k] = ln.astype(np.int32)
        if not ids:
            for k in self.options.json_keys:
                out.tokens[k] = np.zeros(0, self.dtype)
                out.lengths[k] = np.zeros(0, np.int32)
        return out


# One encoder per worker process, built by the pool initializer.
_ENCODER = None


def init_worker(options, preloaded: Tokenizer | None = None, encoder_class=BlockEncoder) -> None:
    """Pool initializer. ``preloaded``: the writing process's own tokenizer (same options), which forked workers
    inherit instead of loading the files again (a GPT-2/HF tokenizer takes ~0.5 s to parse). ``encoder_class``:
    ``BlockEncoder`` (`text`) or another class with its constructor and ``encode`` (`sft`)."""
    global _ENCODER
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled once, by the writing process
    if sys.platform.startswith("linux"):
        # A killed writing process must not leave its workers waiting forever for work that never comes.
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    _ENCODER = encoder_class(options, preloaded)


def encode_in_worker(block: Block | TableBlock) -> EncodedBlock:
    assert _ENCODER is not None, "init_worker was not run in this process"
    return _ENCODER.encode(block)
