"""parallel.fsdp with train.compile: the blocks' forward is compiled while FSDP's gather/free hooks stay on the
block's (eager) call, so compile+FSDP at DP2 trains exactly like compile at DP1, with the same graphs, no graph
break and no recompile. The CPU proof uses dynamo + AOT autograd (``backend="aot_eager"``, patched in by the test):
Inductor also runs on this CPU (checked by hand: equal losses), but its compile costs ~25 s per process."""

from __future__ import annotations

import functools

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=3e-3",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64", "train.compile=true"]


def _train_compiled(rank: int, world_size: int, run_dir: str, extra: list[str]):
    from torch._dynamo.utils import counters

    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # this forked rank only
    counters.clear()
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    return (result.losses, counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()),
            sum(counters["graph_break"].values()))


@pytest.fixture(scope="module")
def compiled_reference(tmp_path_factory):
    return run_distributed(_train_compiled, 1, str(tmp_path_factory.mktemp("ref")), [])[0]


def test_compiled_fsdp_equals_compiled_one_process(tmp_path, compiled_reference):
    ref_losses, ref_graphs, ref_recompiles, _ = compiled_reference
    for losses, graphs, recompiles, breaks in run_distributed(
            _train_compiled, 2, str(tmp_path), ["parallel.dp=2", "parallel.fsdp=true"]):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert breaks == 0, "FSDP's hooks were traced into the compiled blocks"
        assert graphs == ref_graphs and recompiles == ref_recompiles == 0
