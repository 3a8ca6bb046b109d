"""Output side of `mmtrain-prep text` (and merge): file names, the rejects log, the manifest, the summary.

Completion protocol, so that a killed or failed run never leaves files that look complete and never costs
a complete earlier output: everything is written beside the old files under hidden temporaries and
fsynced; only when the new set is complete does `replace_outputs` switch over -- the old
``PREFIX.manifest.json`` (the "this is complete" marker) is removed, the new ``.bin``/``.idx`` pairs and
rejects log are renamed into place, and the new manifest is written last. ``verify`` treats a pair
without its manifest as incomplete.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path

from dataprep.jsonl import jsonl_line
from mmtrain.core.indexed import bin_path, default_file_mode, idx_path
from mmtrain.utils.atomic import atomic_write_text, fsync_dir

MANIFEST_FORMAT = "mmtrain-prep-text/1"


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.manifest.json")


def rejects_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.rejects.jsonl")


def key_prefixes(prefix: str, keys: tuple[str, ...]) -> dict[str, str]:
    """One key -> PREFIX itself; several -> PREFIX_<key> each."""
    if len(keys) == 1:
        return {keys[0]: prefix}
    return {k: f"{prefix}_{k}" for k in keys}


def failed_rejects_path(prefix: str | os.PathLike) -> Path:
    """Where a run that wrote nothing puts its rejects when a complete earlier output owns PREFIX.rejects.jsonl."""
    return Path(f"{os.fspath(prefix)}.failed.rejects.jsonl")


def output_paths(prefix: str, data_prefixes: list[str]) -> set[Path]:
    """Every file a run with this prefix writes (resolved): a run never reads these as input."""
    paths = [manifest_path(prefix), rejects_path(prefix), failed_rejects_path(prefix)]
    for p in data_prefixes:
        paths += [idx_path(p), bin_path(p)]
    return {p.resolve() for p in paths}


def replace_outputs(prefix: str, writers, rejects: "RejectLog | None") -> Path | None:
    """Switch PREFIX over to a new complete set: ``writers`` (IndexedDatasetWriter) finished, ``rejects``
    finished. The old manifest goes first (a crash from here on leaves no manifest, i.e. "incomplete", not a
    mix that passes for complete), then the pairs and the rejects log are renamed over the old files and
    a rejects log the new run does not have is removed. The caller writes the new manifest next."""
    path = manifest_path(prefix)
    if path.exists():
        os.unlink(path)
        fsync_dir(path.parent)
    for w in writers:
        w.commit()
    new_rejects = rejects.commit_to(rejects_path(prefix)) if rejects is not None else None
    stale = [failed_rejects_path(prefix)] + ([] if new_rejects else [rejects_path(prefix)])
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    return new_rejects


class RejectLog:
    """Streams reject records to a temporary; ``commit_to`` renames it into place if non-empty."""

    def __init__(self, prefix: str) -> None:
        self.path = rejects_path(prefix)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "w", encoding="utf-8")
        self.count = 0
        self.codes: collections.Counter = collections.Counter()

    def add(self, file: str, line: int | dict, reason: str, excerpt: str, code: str = "bad_record",
            rows: int = 1) -> None:
        """``line``: a JSONL line number, or the location fields of a table row ({"row_group": 2, "row": 7}).
        ``rows`` > 1: one record for that many consecutive rows from there (a corrupt Parquet row group's),
        written with a ``rows`` field and counted as that many rejects."""
        where = line if isinstance(line, dict) else {"line": line}
        if rows != 1:
            where = {**where, "rows": rows}
        self._f.write(jsonl_line({"file": file, **where, "code": code, "reason": reason, "excerpt": excerpt}))
        self.count += rows
        self.codes[code] += rows

    def summary(self) -> str:
        """'120 rejected (missing_key: 100, not_a_string: 20)'."""
        by_code = ", ".join(f"{k}: {v}" for k, v in sorted(self.codes.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{self.count:,} rejected" + (f" ({by_code})" if by_code else "")

    def commit(self) -> Path | None:
        return self.commit_to(self.path)

    def commit_to(self, path: Path) -> Path | None:
        """fsync; rename the log to ``path`` (None and nothing written when it is empty)."""
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if not self.count:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            return None
        os.chmod(self._tmp, default_file_mode())
        os.replace(self._tmp, path)
        fsync_dir(path.parent)
        return path

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def write_manifest(prefix: str, manifest: dict) -> Path:
    manifest = {"format": MANIFEST_FORMAT,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **manifest}
    return atomic_write_text(manifest_path(prefix), json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def read_manifest(prefix: str) -> dict | None:
    path = manifest_path(prefix)
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def human_rate(n: float, seconds: float, unit: str = "") -> str:
    rate = n / seconds if seconds > 0 else 0.0
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}{unit}/s"
    return f"{rate:.1f}{unit}/s"


def print_summary(title: str, counts: dict, tokens: int, text_bytes: int, seconds: float,
                  outputs: list[str], rejects: Path | None, stream=None, inputs: str | None = None) -> None:
    """``inputs``: which files were read and which a folder or glob turned up but were skipped."""
    stream = stream or sys.stderr
    print(f"{title}: read {counts['read']:,} documents = written {counts['written']:,} + empty "
          f"{counts['empty']:,} + rejected {counts['rejected']:,}"
          + (f" ({counts['blank_lines']:,} blank lines skipped)" if counts.get("blank_lines") else ""), file=stream)
    if inputs:
        print(f"  {inputs}", file=stream)
    print(f"  {tokens:,} tokens from {text_bytes / 1e6:,.1f} MB in {seconds:.1f}s: "
          f"{human_rate(counts['read'], seconds, ' docs')}, {human_rate(text_bytes, seconds, 'B')}, "
          f"{human_rate(tokens, seconds, ' tokens')}", file=stream)
    for out in outputs:
        print(f"  wrote {out}", file=stream)
    if rejects is not None:
        print(f"  rejected records (file, line, reason): {rejects}", file=stream)
