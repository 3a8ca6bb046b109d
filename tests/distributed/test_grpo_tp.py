"""GRPO under tensor parallelism equals one process: two steps of a TP2 run (the rollouts decoded by the TP-sharded
stage itself, rewards scored on the group's first rank, the frozen reference and the tempered vocab-parallel
head) give the one-process run's rewards, KL, losses and gradient norms."""

from __future__ import annotations

import numpy as np

from mmtrain.testing import run_distributed
from tests.grpo_helpers import grpo_overrides, metrics_rows, train_rank


def test_tp2_equals_one_process(tmp_path):
    common = ["train.steps=2", "grpo.beta=0.1", "grpo.temperature=0.8", "grpo.epsilon_high=0.28", "optim.lr=0.05"]
    one = run_distributed(train_rank, 1, grpo_overrides(tmp_path / "one", *common))[0]
    tp2 = run_distributed(train_rank, 2, grpo_overrides(tmp_path / "tp2", *common, "parallel.tp=2"))
    assert tp2[0] == tp2[1]  # both ranks of the group saw the same step
    np.testing.assert_allclose(tp2[0][0], one[0], rtol=1e-4, atol=1e-6)  # losses
    np.testing.assert_allclose(tp2[0][1], one[1], rtol=1e-4)  # gradient norms
    a, b = metrics_rows(tmp_path / "one" / "run"), metrics_rows(tmp_path / "tp2" / "run")
    for key in ("reward", "reward_std", "completion_length", "kl", "clip_ratio"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-4, atol=1e-7, err_msg=key)
    assert a[1]["kl"] > 0 and a[0]["reward"] != a[1]["reward"]  # the second step's rollouts came from new weights
