"""The user guide's folder, made once per test session: docs/user-guide.md runs in it (its own test checks what it
says), and the pages that start where it ends (post-training, generate/serve, evaluate) run in copies of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.doc_runner import GUIDE, run_page


@pytest.fixture(scope="session")
def guide_folder(tmp_path_factory) -> Path:
    """The folder docs/user-guide.md ran in, from empty. Read-only for tests: copy it (doc_runner.copy_folder)
    before running anything there."""
    pytest.importorskip("transformers")  # step 9 loads the export (the guide installs mmtrain[hf])
    work = tmp_path_factory.mktemp("user_guide") / "guide"
    work.mkdir()
    run_page(GUIDE, work)
    return work
