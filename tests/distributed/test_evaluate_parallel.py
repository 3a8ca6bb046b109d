"""mmtrain.evaluate at TP2, PP2 and DP2 (gloo) gives the one-process loss, token count and sample count."""

from __future__ import annotations

import pytest
import torch

from mmtrain.evaluate import eval_run_config, evaluate_checkpoint
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from tests.eval_helpers import write_tiny_checkpoint, write_tiny_dataset

pytestmark = pytest.mark.distributed

LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (tp, pp); the rest of the world is data parallel


def _evaluate(rank: int, world_size: int, ckpt: str, prefix: str, layouts) -> list:
    out = []
    for tp, pp in layouts:
        cfg = eval_run_config(ckpt, prefix, seq_length=16, batch_size=2, tp=tp, pp=pp, data_split="80,20,0",
                              device="cpu")
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
        r = evaluate_checkpoint(cfg, mesh, torch.device("cpu"), ckpt, "valid", max_samples=5)  # 5: a padded last batch
        out.append((r.samples, r.tokens, r.loss))
    return out


def test_tp2_pp2_dp2_equal_one_process(tmp_path):
    ckpt, _ = write_tiny_checkpoint(tmp_path / "ckpt", pp=2)
    prefix = write_tiny_dataset(tmp_path / "data")
    results = run_distributed(_evaluate, 2, str(ckpt), str(prefix), LAYOUTS)
    alone = run_distributed(_evaluate, 1, str(ckpt), str(prefix), [(1, 1)])[0][0]
    for rank_results in results:
        for (tp, pp), (samples, tokens, loss) in zip(LAYOUTS, rank_results):
            assert (samples, tokens) == alone[:2] == (5, 5 * 16), (tp, pp)
            assert loss == pytest.approx(alone[2], rel=1e-5), (tp, pp)
