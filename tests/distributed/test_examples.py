"""examples/simple_train_loop.py runs under torchrun with TP=2 and with PP=2 and reloads exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmtrain.testing import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_simple_train_loop_example(flag, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "examples" / "simple_train_loop.py"), flag, "2", "--ckpt", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 10  loss" in proc.stdout and "reloaded step 10" in proc.stdout
