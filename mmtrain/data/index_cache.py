"""A folder of cached index arrays, keyed by a hash of everything that shapes them.

Each entry is ``NAME-HASH.<array>.npy`` files plus ``NAME-HASH.json`` (the parameters, written last: its
presence means the entry is complete). Every file is written atomically, so a crashed or concurrent build
never leaves a torn entry; two builders of the same entry write identical bytes.

In a multi-process job only one process per node builds: the caller says which (``builder``: local rank 0 of
the node, ``ParallelMesh.node_local_rank``); the others wait for the entry to appear, up to a timeout, then
fail with a message saying what they waited for. Loading memory-maps the arrays read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mmtrain.utils.atomic import atomic_write_text, fsync_dir, temp_next_to
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")

_POLL_S = 0.2


class IndexCacheTimeout(RuntimeError):
    """A non-building process waited longer than its timeout for the index cache entry."""


def _params_hash(params: dict) -> str:
    """A short stable hash of JSON-able parameters (key order does not matter)."""
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_identity(path: str | os.PathLike) -> dict:
    """Absolute path, size and modification time: changes when the file is rewritten."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_npy(path: Path, value: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, value, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


class IndexCache:
    """One cache entry: ``load_or_build(build)`` returns (arrays, built). ``builder``: whether this process builds
    a missing entry (one process per node; the others wait for it). Two builders are safe, only wasteful."""

    def __init__(self, folder: str | os.PathLike, name: str, params: dict, timeout_s: float = 1800.0,
                 builder: bool = True) -> None:
        self.folder = Path(folder)
        self.builder = builder
        self.params = params
        self.key = _params_hash(params)
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
        with self.writer() as put:
            for name, value in arrays.items():
                put(name, value)

    @contextlib.contextmanager
    def writer(self) -> Iterator[Callable[[str, np.ndarray], None]]:
        """``with cache.writer() as put: put(name, array) ...``: each array is written and fsynced to a
        temporary in the background as soon as it is put (so disk time overlaps the next array's computation);
        on success all are renamed into place, the folder synced once, and the description written last."""
        self.folder.mkdir(parents=True, exist_ok=True)
        temps: dict[str, Path] = {}
        futures = []
        pool = ThreadPoolExecutor(2)  # file writes and fsync release the GIL

        def put(name: str, value: np.ndarray) -> None:
            fd, tmp = temp_next_to(self.array_path(name))  # at the umask's mode, not mkstemp's 0o600
            os.close(fd)
            temps[name] = tmp
            futures.append(pool.submit(_write_npy, tmp, np.ascontiguousarray(value)))

        try:
            yield put
            for f in futures:
                f.result()
            for name, tmp in temps.items():
                os.replace(tmp, self.array_path(name))
            fsync_dir(self.folder)
            atomic_write_text(self.description, json.dumps({"params": self.params, "arrays": list(temps)},
                                                           indent=1, sort_keys=True, default=str) + "\n")
        finally:
            pool.shutdown(wait=True)
            for tmp in temps.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.exists():
            if time.monotonic() >= deadline:
                raise IndexCacheTimeout(
                    f"waited {self.timeout_s:.0f} s for local rank 0 of this node to build {self.description}; "
                    "check that process's log for its error, or raise data.index_build_timeout_s if the "
                    "build is just slow (a cache folder shared by all ranks of the node is required)")
            time.sleep(_POLL_S)

    def load_or_build(self, build: Callable[[Callable[[str, np.ndarray], None]], None]
                      ) -> tuple[dict[str, np.ndarray], bool]:
        """Arrays from the cache, or ``build(put)`` run (it calls ``put(name, array)`` for each array, as soon
        as each is ready) and saved; ``built`` says which happened."""
        if self.exists():
            return self.load(), False
        if not self.builder:
            self.wait()
            return self.load(), False
        started = time.monotonic()
        with self.writer() as put:
            build(put)
        log.info("built %s in %.2f s", self.description.name, time.monotonic() - started)
        return self.load(), True
