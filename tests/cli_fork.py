"""An entry point's ``main(argv)`` in a process forked from the rank server (mmtrain/testing.py), as a fresh
``python -m`` would run it: the caller's environment and working directory, its own stdout and stderr (file
descriptors: C++ and child writes too), ``main``'s return value as the exit code. torch and mmtrain are imported
there already: a command that runs for a second no longer pays ~4 s of start-up imports. Tests that check what
start-up itself does (imports, a launcher, signals) still start a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def _child(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], cwd: str, out: str,
           err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class ForkedMain:
    """A started ``main(argv)``; ``finish()`` waits for it: (exit code, stdout, stderr), like ``Popen``'s."""

    def __init__(self, main: Callable[[list[str]], int], argv: list[str], env: dict[str, str] | None = None):
        from mmtrain.testing import _context

        self._dir = tempfile.TemporaryDirectory(prefix="cli_fork.")
        self._out, self._err = Path(self._dir.name) / "stdout", Path(self._dir.name) / "stderr"
        self._out.touch()
        self._err.touch()
        self._proc = _context().Process(target=_child, args=(main, list(argv), {**os.environ, **(env or {})},
                                                             os.getcwd(), str(self._out), str(self._err)))
        self._proc.start()

    def wait_for_output(self, text: str, timeout: float = 120) -> bool:
        """Whether ``text`` appeared in its stdout within ``timeout`` (False: it ended or the time ran out)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self._proc.is_alive()  # before reading: what it wrote before ending is in the file
            if text in self._out.read_text(errors="replace"):
                return True
            if not alive:
                return False
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL, as ``Popen.kill``: ``finish`` then reports exit code -9."""
        self._proc.kill()

    def terminate(self) -> None:
        """SIGTERM, as ``Popen.terminate``."""
        self._proc.terminate()

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
            raise subprocess.TimeoutExpired("main", timeout)
        try:
            return (self._proc.exitcode, self._out.read_text(errors="replace"),
                    self._err.read_text(errors="replace"))
        finally:
            self._dir.cleanup()


def run_main(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """``main(argv)`` to its end, as ``subprocess.run(..., capture_output=True, text=True)`` reports it."""
    code, out, err = ForkedMain(main, argv, env).finish(timeout)
    return subprocess.CompletedProcess(["main", *argv], code, out, err)
