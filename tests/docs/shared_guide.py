"""The user guide's folder shared by one test run's processes (the docs pages start where the guide ends).

``build_shared_guide(root)`` runs docs/user-guide.md once in ``root/user_guide_shared/guide`` under a file lock: the
first process to take the lock builds, the others wait and reuse its folder. Under pytest-xdist the controller
process, which runs no tests, starts this module in the background at the start of the run (``python -m
tests.docs.shared_guide ROOT``, tests/conftest.py): the guide is then built beside the workers' other tests instead
of a worker waiting idle for it when the docs pages come. A background build that failed leaves no done marker:
the fixture builds again and its test reports the failure."""

from __future__ import annotations

import fcntl
import shutil
import signal
import sys
from pathlib import Path

from tests.docs.doc_runner import GUIDE, run_page


def build_shared_guide(root: Path) -> Path:
    """The folder docs/user-guide.md ran in, from empty (built now unless a process of this run already has)."""
    shared, done = root / "user_guide_shared", root / "user_guide_shared.done"
    with open(root / "user_guide_shared.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if shared.exists():  # an earlier builder failed part-way: start from empty again
                shutil.rmtree(shared)
            (shared / "guide").mkdir(parents=True)
            run_page(GUIDE, shared / "guide")
            done.touch()
    return shared / "guide"


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # run_page then kills the command it was running


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    build_shared_guide(Path(sys.argv[1]))
