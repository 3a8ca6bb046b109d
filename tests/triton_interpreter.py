"""Running a Triton kernel's CPU test under Triton's interpreter: the interpreter is chosen when Triton is
imported, and the test process may have imported it already, so the test's script runs in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(child: str) -> None:
    """Run the script ``child`` with ``TRITON_INTERPRET=1``; it must print "ok". Skips when the interpreter cannot
    run here at all (an error that is neither the interpreter's report of the kernel nor a failed assertion)."""
    pytest.importorskip("triton", reason="the kernel is written in Triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", child], check=False, cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0 and "InterpreterError" not in out.stderr and "AssertionError" not in out.stderr:
        pytest.skip(f"Triton's interpreter cannot run here: {out.stderr.strip().splitlines()[-1][:200]}")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
