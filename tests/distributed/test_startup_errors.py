"""Under torchrun, a start-up error (config, layout, data path) is printed once, not once per rank, by processes
that never made a process group or a run folder; no mmtrain traceback. torchrun itself reports any worker's
non-zero exit with its own ChildFailedError traceback (torch/distributed/run.py, for every failing program)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mmtrain.testing import free_port

REPO = Path(__file__).resolve().parents[2]


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "mmtrain.pretrain_gpt", *args, f"logging.run_dir={tmp_path / 'run'}"]
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300, env=env)


def test_torchrun_start_up_errors_are_printed_once_without_an_mmtrain_traceback(tmp_path):
    cases = [(["--config", "mmtrain:configs/gpt/tiny_cpu_mock.yaml", "parallel.tp=4"],
              "mmtrain.pretrain_gpt: config error: model.num_query_groups (2) must be divisible by parallel.tp (4)"),
             (["--config", "mmtrain:configs/gpt/tiny_cpu.yaml"],
              f"mmtrain.pretrain_gpt: config error: data.prefixes[0]: indexed dataset {tmp_path}/runs/demo/data/"
              "corpus not found"),
             (["--config", "mmtrain:configs/gpt/tiny_cpu_mock.yaml", "optim.nosuch=1"],  # found while parsing
              "mmtrain.pretrain_gpt: config error: unknown config key 'optim.nosuch' in command-line override "
              "'optim.nosuch=1'; did you mean 'optim.schedule'?")]
    for args, message in cases:
        proc = _torchrun(tmp_path, *args)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert out.count(message) == 1, out  # rank 0 only
        assert "[rank 1]" not in out and "config error" not in out.replace(message, "")
        # the only traceback is torchrun's report that a worker exited non-zero (exit code 2)
        assert out.count("Traceback") == 1 and "ChildFailedError" in out and "exitcode  : 2" in out, out
        # no frame of mmtrain's own package (the clone may itself be named mmtrain, so match the package path)
        package = f'"{REPO / "mmtrain"}/'
        assert package not in "".join(line for line in out.splitlines() if line.strip().startswith("File "))
        assert not (tmp_path / "run").exists()
