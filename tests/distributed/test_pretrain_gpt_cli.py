"""The entry point under torchrun: config file + dotted overrides, resolved config and metrics written,
clean errors for bad configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from mmtrain.testing import free_port

REPO = Path(__file__).resolve().parents[2]


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           "-m", "mmtrain.pretrain_gpt", "--config", str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                          **{k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"}})


def test_torchrun_tp2_writes_config_metrics_and_checkpoint(tmp_path):
    proc = _torchrun(2, "parallel.tp=2", "train.steps=3", f"logging.run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3/3 | loss" in proc.stdout
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["parallel"]["tp"] == 2 and resolved["train"]["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_bad_config_is_a_clean_error(tmp_path):
    # both commands at once: each mostly imports torch, and there are two cores
    bad_layout, typo = (subprocess.Popen([sys.executable, "-m", "mmtrain.pretrain_gpt", *args], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
                        for args in (["--config", str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), "parallel.tp=3"],
                                     ["optim.lrr=1"]))
    _, stderr = bad_layout.communicate(timeout=120)
    assert bad_layout.returncode == 2
    assert "model.num_attention_heads (4) must be divisible by parallel.tp (3)" in stderr
    assert "Traceback" not in stderr
    _, stderr = typo.communicate(timeout=120)
    assert typo.returncode == 2 and "did you mean 'optim.lr'" in stderr


def test_bad_numeric_value_and_unwritable_run_dir_are_one_line_exit_2(tmp_path):
    (tmp_path / "a_file").write_text("")
    cases = [(["optim.lr=nan"], "config error: optim.lr must be a finite number (> 0), got nan"),
             ([f"logging.run_dir={tmp_path / 'a_file' / 'run'}"],
              f"config error: logging.run_dir={tmp_path / 'a_file' / 'run'}: cannot write there (Not a directory")]
    procs = [subprocess.Popen([sys.executable, "-m", "mmtrain.pretrain_gpt", "--config",
                               str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for proc, (_, message) in zip(procs, cases):
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2 and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_resume_with_another_schedule_is_one_line_exit_2(tmp_path):
    from mmtrain.pretrain_gpt import main
    from tests.cli_fork import run_main

    def run(*args):  # python -m mmtrain.pretrain_gpt, forked with torch imported (tests/cli_fork.py)
        return run_main(main, ["--config", str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), "train.steps=4",
                               f"logging.run_dir={tmp_path}", "model.num_layers=1", *args], timeout=300)

    first = run("train.exit_at_step=2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    proc = run("train.steps=6")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "train.steps: 4 in the checkpoint, 6 now" in errors[0], errors
    assert "Traceback" not in proc.stdout + proc.stderr
