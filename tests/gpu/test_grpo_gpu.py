"""GRPO on the GPU (skipped without CUDA): with ``train.compile=true`` the rollouts decode through the compiled step
(CUDA graphs, captured once while the optimizer updates the weights in place), and the tiny toy task of
tests/unit/test_grpo.py still learns: no rollout fails and the mean reward rises as on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.parallel import ParallelDims, init_distributed
from mmtrain.train.loop import train_gpt
from tests.grpo_helpers import grpo_overrides, metrics_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_compiled_rollouts_learn_the_toy_task(tmp_path):
    init_distributed("nccl", torch.device("cuda", 0))
    overrides = grpo_overrides(tmp_path, "train.steps=30", "train.device=cuda", "train.compile=true")
    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, 1)
    train_gpt(cfg, ParallelDims(world_size=1).build(), torch.device("cuda", 0))
    rows = metrics_rows(tmp_path / "run")
    rewards = [r["reward"] for r in rows]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert len(rows) == 30 and last > 2 * first and last > first + 0.08, rewards
    assert all(r["rollout_errors"] == 0 and r["reward_errors"] == 0 for r in rows)
