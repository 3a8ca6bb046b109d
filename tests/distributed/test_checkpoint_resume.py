"""Save at step k, resume in a new process: the continuation equals the uninterrupted run bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.checkpoint import CheckpointError
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=6",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=64",
        "checkpoint.save_every=3", "checkpoint.keep_last=0"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


@pytest.mark.parametrize("world_size, layout", [(2, ["parallel.dp=2"]), (2, ["parallel.pp=2"])])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, world_size, layout):
    full = run_distributed(_train, world_size, str(tmp_path / "full"), layout)[0]
    assert len(full) == 6
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", resumed_dir / "step_00000003")
    (resumed_dir / "latest").write_text("step_00000003\n")
    tail = run_distributed(_train, world_size, str(tmp_path / "resumed"), layout)[0]
    assert tail == full[3:]  # bit for bit


def test_layout_change_is_a_clear_error(tmp_path):
    run_distributed(_train, 1, str(tmp_path), ["train.steps=3"])
    with pytest.raises(Exception, match="saved with layout .*resharding"):
        run_distributed(_train, 2, str(tmp_path), ["parallel.dp=2", "train.steps=6"])
    assert issubclass(CheckpointError, RuntimeError)
