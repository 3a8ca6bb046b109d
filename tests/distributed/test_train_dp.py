"""Data parallelism trains exactly like one process (fp32, deterministic): same losses, same weights."""

from __future__ import annotations

import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

OVERRIDES = ["data.mock=true", "data.seq_length=32", "train.precision=fp32", "train.device=cpu", "train.steps=10",
             "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]) -> list[float]:
    cfg = load_config(GPTRunConfig, None, [*OVERRIDES, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu"))


def test_dp2_equals_one_process(tmp_path):
    single = run_distributed(_train, 1, str(tmp_path / "single"), [])[0]
    dp2 = run_distributed(_train, 2, str(tmp_path / "dp2"), [])
    assert dp2[0] == dp2[1]
    torch.testing.assert_close(torch.tensor(dp2[0]), torch.tensor(single), rtol=1e-5, atol=0)
