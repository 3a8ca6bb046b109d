"""The step loop's cross-cutting features sit behind StepHooks: the loop does not name FP8, and the hooks hand
their per-step values back as device tensors that only host_metrics (at logging steps) reads."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from types import SimpleNamespace

import torch

from mmtrain.train.precision import Precision
from mmtrain.train.step_hooks import PreemptionCheck, RouterBiasBalancer, StepHooks

REPO = Path(__file__).resolve().parents[2]


def test_the_loop_does_not_name_fp8():
    source = (REPO / "mmtrain" / "train" / "loop.py").read_text(encoding="utf-8")
    assert not re.search("fp8", source, re.IGNORECASE)


def test_plain_precision_changes_nothing():
    p = Precision()
    assert isinstance(p, StepHooks) and p.bucket_options() == {}
    p.start(), p.after_backward(1), p.after_optimizer_step(1)
    assert p.step_metrics(1) == {} and not p.stop_requested(True)


def test_router_loads_stay_tensors_until_host_metrics():
    hook = RouterBiasBalancer.__new__(RouterBiasBalancer)
    hook.loads = {"layers.0.mlp": torch.tensor([3.0, 1.0]), "layers.1.mlp": torch.tensor([2.0, 2.0])}
    values = hook.step_metrics(1)
    assert all(isinstance(v, torch.Tensor) for v in values["moe_load"].values())
    assert hook.step_metrics(2) == {}  # read once
    row = hook.host_metrics(values)
    assert row == {"moe_max_load": 1.5, "moe_load": {"layers.0.mlp": [3, 1], "layers.1.mlp": [2, 2]}}


def test_one_process_acts_on_sigterm_after_the_step_without_a_collective():
    mesh = SimpleNamespace(dims=SimpleNamespace(world_size=1))
    check = PreemptionCheck(mesh, torch.device("cpu"))
    try:
        assert not check.stop_requested(False)
        signal.raise_signal(signal.SIGTERM)
        assert check.stop_requested(False)  # not a sync point: one process reads its host flag
    finally:
        check.close()
