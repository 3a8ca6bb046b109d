"""Atomic file writes: write to a temporary in the same folder, fsync, rename over the target.

A reader (or a crashed run) therefore sees either the old file or the complete new one, never a torn one.
The file ends with the mode a plain ``open(path, "w")`` would give (0o666 minus the umask), not the 0o600 of
``tempfile.mkstemp``: manifests, checkpoints and exports are read by colleagues on shared filesystems.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Iterator


_UMASK_LOCK = threading.Lock()


def _umask_from_proc() -> int | None:
    """The umask from ``/proc/self/status`` (Linux 4.7+), read without changing it; None where unavailable."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_umask() -> int:
    """The process umask. os.umask can only be read by setting it, and it is process-wide: a file another
    thread creates between the set and the restore gets the probe's mask; so Linux's read-only copy is used
    where it exists, and the set-and-restore only elsewhere (under a lock, with a private probe 0o077 so a
    racing file is at worst too private, never world-writable)."""
    mask = _umask_from_proc()
    if mask is not None:
        return mask
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """0o666 minus the umask: the mode a plain ``open()`` gives a new file, which every output should have."""
    return 0o666 & ~current_umask()


def temp_next_to(path: str | os.PathLike, suffix: str = ".tmp") -> tuple[int, Path]:
    """A new hidden temporary ``.NAME.XXXX<suffix>`` in ``path``'s folder, already at :func:`file_mode`
    (mkstemp creates it 0o600), so renaming it over ``path`` gives the file the umask's mode. Returns (fd, path)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a rename by syncing the folder that holds the entry (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kw) -> Iterator[IO]:
    """``with atomic_open(p, "w") as f: ...`` — the file appears at ``p`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_next_to(path)
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)
