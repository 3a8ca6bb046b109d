"""The Slurm example: valid bash, and the torchrun command it assembles from SLURM variables."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "pretrain.sbatch"


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_command_assembled_from_slurm_variables(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")  # `scontrol show hostnames`
    (fake / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_GPUS_ON_NODE": "8", "DRY_RUN": "1",
           "ENTRY": "mmtrain.pretrain_vlm"}
    out = subprocess.run(["bash", str(SCRIPT), "--config", "configs/x.yaml", "parallel.tp=8"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[:5] == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8"]
    assert "node-a:24242" in out and "mmtrain.pretrain_vlm" in out
    assert out[-3:] == ["--config", "configs/x.yaml", "parallel.tp=8"]


def test_outside_slurm_is_a_clear_error():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "SLURM_NNODES unset" in proc.stderr
