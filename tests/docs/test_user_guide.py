"""docs/user-guide.md is executable: its shell blocks run in order in an empty folder on the CPU, with the files
its marked blocks give, so the guide cannot drift from the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.guide_blocks import page_blocks

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "user-guide.md"


def guide_env() -> dict[str, str]:
    """This interpreter's environment first on PATH (python, torchrun, mmtrain-prep), this tree's code first."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    bin_dir = str(Path(sys.executable).parent)
    return {**env, "PATH": bin_dir + os.pathsep + env.get("PATH", ""), "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1"}


def test_guide_markers_are_few_and_known():
    blocks = page_blocks(GUIDE.read_text(encoding="utf-8"))
    kinds = [b.kind for b in blocks]
    assert kinds.count("skip") <= 2, [b.line for b in blocks if b.kind == "skip"]  # keep what is not run small
    assert kinds.count("run") >= 8 and {b.file for b in blocks if b.kind == "file"} >= {"blend.yaml", "run.yaml"}


def test_user_guide_runs_from_an_empty_folder(tmp_path):
    pytest.importorskip("transformers")  # step 9 loads the export (the guide installs mmtrain[hf])
    work = tmp_path / "guide"
    work.mkdir()
    env = guide_env()
    for block in page_blocks(GUIDE.read_text(encoding="utf-8")):
        if block.kind == "file":
            (work / block.file).write_text(block.body, encoding="utf-8")
        elif block.kind == "run":
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, (f"docs/user-guide.md line {block.line}: exit {proc.returncode}\n"
                                          f"{block.body}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                                          f"{proc.stderr[-3000:]}")
    # what the guide says happened did happen
    rows = [json.loads(line) for line in (work / "runs/guide/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))  # stopped at 40 (step 6), resumed to 60 (step 8)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert (work / "hf-tiny" / "config.json").is_file()
    assert (work / "hf-tiny" / "tokenizer.json").is_file()  # the checkpoint names its data's tokenizer
    vlm = [json.loads(line) for line in (work / "runs/vlm/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in vlm] == list(range(1, 11))
