"""Fault handling: NaN/Inf skip or stop naming step and rank; SIGTERM saves a checkpoint and exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import DistributedTestFailure, run_distributed
from mmtrain.train import loop

REPO = Path(__file__).resolve().parents[2]
BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=5",
        "train.micro_batch_size=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=64",
        "checkpoint.save_final=false"]


def _train_with_nan(rank: int, world_size: int, run_dir: str, extra: list[str]):
    """Rank 1's loss is NaN in the forward of step 3."""
    original = loop.build_gpt_stage

    def build(cfg, mesh, device):
        stage = original(cfg, mesh, device)
        calls = {"n": 0}

        def poison(module, args, out):
            calls["n"] += 1
            return out * float("nan") if (rank == 1 and calls["n"] == 3) else out
        stage.register_forward_hook(poison)
        return stage

    loop.build_gpt_stage = build
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", "parallel.dp=2", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return loop.train_gpt(cfg, mesh, torch.device("cpu")).losses


def test_nan_step_is_skipped_and_training_goes_on(tmp_path):
    losses = run_distributed(_train_with_nan, 2, str(tmp_path), [])[0]
    assert len(losses) == 5 and torch.isnan(torch.tensor(losses[2]))
    assert all(torch.isfinite(torch.tensor(losses[:2] + losses[3:])))


def test_nan_policy_stop_names_step_and_rank(tmp_path):
    with pytest.raises(DistributedTestFailure, match=r"NonFiniteError: step 3: loss nan.*non-finite loss on rank\(s\) \[1\]"):
        run_distributed(_train_with_nan, 2, str(tmp_path), ["train.nan_policy=stop"])
    with pytest.raises(DistributedTestFailure, match="1 step\\(s\\) skipped, train.max_skipped_steps=0"):
        run_distributed(_train_with_nan, 2, str(tmp_path / "b"), ["train.max_skipped_steps=0"])


def test_nan_between_logging_steps_is_skipped_on_the_device_and_reported_at_the_next(tmp_path):
    # step 3 is no logging step (log_every=5): its update is skipped on the device, the policy reads it at step 5
    losses = run_distributed(_train_with_nan, 2, str(tmp_path), ["logging.log_every=5"])[0]
    assert len(losses) == 5 and torch.isnan(torch.tensor(losses[2]))
    assert all(torch.isfinite(torch.tensor(losses[:2] + losses[3:])))  # a NaN update would poison steps 4 and 5
    with pytest.raises(DistributedTestFailure, match=r"NonFiniteError: step 3: loss nan.*non-finite loss on rank\(s\) \[1\]"):
        run_distributed(_train_with_nan, 2, str(tmp_path / "b"), ["train.nan_policy=stop", "logging.log_every=5"])


def test_sigterm_saves_and_exits_zero_then_restart_resumes(tmp_path):
    from mmtrain.pretrain_gpt import main
    from tests.cli_fork import ForkedMain, run_main

    # python -m mmtrain.pretrain_gpt, forked with torch imported (tests/cli_fork.py): a process of its own to signal
    argv = ["--config", str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), "train.steps=100000",
            f"logging.run_dir={tmp_path}"]
    proc = ForkedMain(main, argv)
    reached = proc.wait_for_output("step 3/100000", timeout=120)
    if reached:
        proc.terminate()
    code, out, err = proc.finish(timeout=120)
    assert reached and code == 0, out + err
    assert "SIGTERM received: saved step" in out
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    saved_step = int(latest.split("_")[1])
    assert saved_step >= 3
    # the same run (train.steps is its schedule), stopped two steps later
    again = run_main(main, [*argv, f"train.exit_at_step={saved_step + 2}"], timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"(step {saved_step})" in again.stdout and f"step {saved_step + 2}/100000" in again.stdout
    assert f"train.exit_at_step={saved_step + 2} reached" in again.stdout


def _stuck_peer(rank: int, world_size: int, run_dir: str):
    import time as _time

    original = loop.build_gpt_stage
    rank0_failed = Path(run_dir) / "rank0_failed"

    def build(cfg, mesh, device):
        stage = original(cfg, mesh, device)
        if rank == 1:  # rank 1 hangs (up to 20 s); rank 0 waits in its first collective
            deadline = _time.monotonic() + 20
            while not rank0_failed.exists() and _time.monotonic() < deadline:
                _time.sleep(0.05)
            # rank 0 has failed: end soon rather than sleep on until the harness's 10 s grace period kills it;
            # soon, not at once: rank 0 still reports (traceback and output) after touching the file
            _time.sleep(2)
            raise RuntimeError("the stuck peer, released after rank 0 failed")
        return stage

    loop.build_gpt_stage = build
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", "parallel.dp=2",
                                           "parallel.collective_timeout_s=3"])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build(timeout_s=cfg.parallel.collective_timeout_s)
    try:
        return loop.train_gpt(cfg, mesh, torch.device("cpu")).losses
    except BaseException:
        if rank == 0:
            rank0_failed.touch()
        raise


def test_collective_timeout_names_rank_step_and_phase(tmp_path):
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 0 of 2 failed.*CollectiveTimeout: rank 0: a collective "
                                                     r"during .* of step 1 did not complete within 3s"):
        run_distributed(_stuck_peer, 2, str(tmp_path), pg_timeout_s=3)
