"""The user guide's folder, made once per test session: docs/user-guide.md runs in it (its own test checks what it
says), and the pages that start where it ends (post-training, generate/serve, evaluate) run in copies of it."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

import pytest

from tests.docs.doc_runner import GUIDE, run_page


@pytest.fixture(scope="session")
def guide_folder(tmp_path_factory, request) -> Path:
    """The folder docs/user-guide.md ran in, from empty. Read-only for tests: copy it (doc_runner.copy_folder)
    before running anything there. Built once per test run: pytest-xdist's workers share the run's temporary root
    (``getbasetemp().parent``); the first to take the lock builds, the others wait and reuse its folder."""
    pytest.importorskip("transformers")  # step 9 loads the export (the guide installs mmtrain[hf])
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # a pytest-xdist worker: the run's root is one level up
        root = root.parent
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
