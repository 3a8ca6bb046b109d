"""The user guide's folder, made once per test session: docs/user-guide.md runs in it (its own test checks what it
says), and the pages that start where it ends (post-training, generate/serve, evaluate) run in copies of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.shared_guide import build_shared_guide


@pytest.fixture(scope="session")
def guide_folder(tmp_path_factory, request) -> Path:
    """The folder docs/user-guide.md ran in, from empty. Read-only for tests: copy it (doc_runner.copy_folder)
    before running anything there. Built once per test run (tests/docs/shared_guide.py): pytest-xdist's workers
    share the run's temporary root (``getbasetemp().parent``), where the controller started building it."""
    pytest.importorskip("transformers")  # step 9 loads the export (the guide installs mmtrain[hf])
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # a pytest-xdist worker: the run's root is one level up
        root = root.parent
    return build_shared_guide(root)
