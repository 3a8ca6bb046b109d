"""Output side of `mmtrain-prep text` (and merge): file names, the rejects log, the manifest, the summary.

Completion protocol, so that a killed run never leaves files that look complete: old outputs of the same
prefix are removed first (manifest first), everything is written under temporary names and fsynced, the
``.bin``/``.idx`` pairs are renamed into place, and ``PREFIX.manifest.json`` -- the "this is complete"
marker -- is written last. ``verify`` treats a pair without its manifest as incomplete.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path

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


def remove_old_outputs(prefix: str, data_prefixes: list[str]) -> None:
    """Delete a previous run's outputs, the manifest first, so no stale set can pass for the new one."""
    paths = [manifest_path(prefix), rejects_path(prefix)]
    for p in data_prefixes:
        paths += [idx_path(p), bin_path(p)]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class RejectLog:
    """Streams reject records to a temporary; ``commit`` renames it to PREFIX.rejects.jsonl if non-empty."""

    def __init__(self, prefix: str) -> None:
        self.path = rejects_path(prefix)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "w", encoding="utf-8")
        self.count = 0

    def add(self, file: str, line: int, reason: str, excerpt: str) -> None:
        self._f.write(json.dumps({"file": file, "line": line, "reason": reason, "excerpt": excerpt},
                                 ensure_ascii=False) + "\n")
        self.count += 1

    def commit(self) -> Path | None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if not self.count:
            os.unlink(self._tmp)
            return None
        os.chmod(self._tmp, default_file_mode())
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        return self.path

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
                  outputs: list[str], rejects: Path | None, stream=None) -> None:
    stream = stream or sys.stderr
    print(f"{title}: read {counts['read']:,} documents = written {counts['written']:,} + empty "
          f"{counts['empty']:,} + rejected {counts['rejected']:,}"
          + (f" ({counts['blank_lines']:,} blank lines skipped)" if counts.get("blank_lines") else ""), file=stream)
    print(f"  {tokens:,} tokens from {text_bytes / 1e6:,.1f} MB in {seconds:.1f}s: "
          f"{human_rate(counts['read'], seconds, ' docs')}, {human_rate(text_bytes, seconds, 'B')}, "
          f"{human_rate(tokens, seconds, ' tokens')}", file=stream)
    for out in outputs:
        print(f"  wrote {out}", file=stream)
    if rejects is not None:
        print(f"  rejected records (file, line, reason): {rejects}", file=stream)
