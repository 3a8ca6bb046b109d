"""Save at step k, resume in a new process: the continuation equals the uninterrupted run bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=6",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=64",
        "checkpoint.save_every=3", "checkpoint.keep_last=0"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


@pytest.mark.parametrize("world_size, layout", [(2, ["parallel.dp=2"]), (2, ["parallel.pp=2"]),
                                                (2, ["parallel.dp=2", "checkpoint.async_save=true"])])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, world_size, layout):
    full = run_distributed(_train, world_size, str(tmp_path / "full"), layout)[0]
    assert len(full) == 6
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", resumed_dir / "step_00000003")
    (resumed_dir / "latest").write_text("step_00000003\n")
    tail = run_distributed(_train, world_size, str(tmp_path / "resumed"), layout)[0]
    assert tail == full[3:]  # bit for bit


def _metrics(run_dir) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a resumed run appends: the last value of a step wins


def test_sigkill_at_a_random_step_then_resume_is_bit_exact(tmp_path):
    import random
    import signal
    from pathlib import Path

    from mmtrain.pretrain_gpt import main
    from tests.cli_fork import ForkedMain, run_main

    # python -m mmtrain.pretrain_gpt, forked with torch imported (tests/cli_fork.py): a process of its own to kill
    config = Path(__file__).resolve().parents[2] / "configs/gpt/tiny_cpu_mock.yaml"
    args = ["train.steps=14", "checkpoint.save_every=2", "checkpoint.keep_last=0", "logging.log_every=1"]
    argv = lambda d: ["--config", str(config), *args, f"logging.run_dir={d}"]  # noqa: E731
    full = run_main(main, argv(tmp_path / "full"), timeout=300)
    assert full.returncode == 0, full.stdout + full.stderr
    kill_at = random.Random().randint(3, 11)
    proc = ForkedMain(main, argv(tmp_path / "killed"))
    if proc.wait_for_output(f"step {kill_at}/14"):
        proc.kill()
    code, out, err = proc.finish(timeout=60)
    assert code == -signal.SIGKILL, (kill_at, out, err)
    resumed = run_main(main, argv(tmp_path / "killed"), timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "full")  # bit for bit, every step


def test_a_save_cut_short_never_hides_the_previous_checkpoint(tmp_path):
    from mmtrain.train.checkpoint import find_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / "complete.json").write_text("{}")
    (root / "latest").write_text("step_00000002\n")
    (root / "step_00000004").mkdir()  # a save killed half-way: a rank file, no marker, latest not moved
    (root / "step_00000004" / ".rank_00000.pt.abc.tmp").write_bytes(b"partial")
    assert find_checkpoint("", str(tmp_path)) == root / "step_00000002"
