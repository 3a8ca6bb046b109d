"""A folder of cached index arrays, keyed by a hash of everything that shapes them.

Each entry is ``NAME-HASH.<array>.npy`` files plus ``NAME-HASH.json`` (the parameters, written last: its
presence means the entry is complete). Every file is written atomically, so a crashed or concurrent build
never leaves a torn entry; two builders of the same entry write identical bytes.

In a multi-process job only one process per node builds (``LOCAL_RANK`` 0, or any process when the variable
is unset); the others wait for the entry to appear, up to a timeout, then fail with a message saying what
they waited for. Loading memory-maps the arrays read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from mmtrain.utils.atomic import atomic_write_text, fsync_dir
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")

_POLL_S = 0.2


class IndexCacheTimeout(RuntimeError):
    """A non-building process waited longer than its timeout for the index cache entry."""


def params_hash(params: dict) -> str:
    """A short stable hash of JSON-able parameters (key order does not matter)."""
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_identity(path: str | os.PathLike) -> dict:
    """Absolute path, size and modification time: changes when the file is rewritten."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_index_builder() -> bool:
    """One process per node builds indices: LOCAL_RANK 0 (a single process has no LOCAL_RANK)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


class IndexCache:
    """``load_or_build(build)`` returns (arrays, built): arrays from the cache, else from ``build()`` saved."""

    def __init__(self, folder: str | os.PathLike, name: str, params: dict, timeout_s: float = 1800.0) -> None:
        self.folder = Path(folder)
        self.params = params
        self.key = params_hash(params)
        self.stem = f"{name}-{self.key}"
        self.description = self.folder / f"{self.stem}.json"
        self.timeout_s = timeout_s

    def array_path(self, array: str) -> Path:
        return self.folder / f"{self.stem}.{array}.npy"

    def exists(self) -> bool:
        return self.description.is_file()

    def load(self) -> dict[str, np.ndarray]:
        names = json.loads(self.description.read_text(encoding="utf-8"))["arrays"]
        return {a: np.load(self.array_path(a), mmap_mode="r", allow_pickle=False) for a in names}

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Write every array to a temporary, fsync them together, rename them into place, then write the
        description (the completion marker) -- the atomic-write pattern of ``mmtrain.utils.atomic``, with the
        fsyncs overlapped and one folder sync, since these files are written together."""
        self.folder.mkdir(parents=True, exist_ok=True)
        temps: list[tuple[Path, Path]] = []
        try:
            for a, value in arrays.items():
                fd, tmp = tempfile.mkstemp(prefix=f".{self.stem}.{a}.", suffix=".tmp", dir=self.folder)
                temps.append((Path(tmp), self.array_path(a)))
                with os.fdopen(fd, "wb") as f:
                    np.save(f, np.ascontiguousarray(value), allow_pickle=False)
            with ThreadPoolExecutor(len(temps) or 1) as pool:  # fsync releases the GIL
                list(pool.map(_fsync_path, [t for t, _ in temps]))
            for tmp, final in temps:
                os.replace(tmp, final)
            fsync_dir(self.folder)
        finally:
            for tmp, _ in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        atomic_write_text(self.description, json.dumps({"params": self.params, "arrays": list(arrays)},
                                                       indent=1, sort_keys=True, default=str) + "\n")

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.exists():
            if time.monotonic() >= deadline:
                raise IndexCacheTimeout(
                    f"waited {self.timeout_s:.0f} s for LOCAL_RANK 0 of this node to build {self.description}; "
                    "check that process's log for its error, or raise data.index_build_timeout_s if the "
                    "build is just slow (a cache folder shared by all ranks of the node is required)")
            time.sleep(_POLL_S)

    def load_or_build(self, build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
        if self.exists():
            return self.load(), False
        if not is_index_builder():
            self.wait()
            return self.load(), False
        started = time.monotonic()
        arrays = build()
        self.save(arrays)
        log.info("built %s in %.2f s", self.description.name, time.monotonic() - started)
        return self.load(), True
