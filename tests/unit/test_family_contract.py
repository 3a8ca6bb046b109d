"""The family contract (``mmtrain.models.contract``): the shared code builds, compiles, recomputes and shards a
family's stage only through its declared members.

Issue #31: ``train.compile=true`` with the DeepSeek-V3 family crashed in the build (it read ``head_matmul``,
which only the Llama family's model had). The run here goes through the trainer's entry point as
``python -m mmtrain.pretrain_gpt --config configs/gpt/deepseek_v3_tiny_cpu_mock.yaml train.compile=true`` would,
in a fresh process; its compiled blocks use dynamo + AOT autograd (``backend="aot_eager"``, patched in for that
process, as tests/distributed/test_fsdp_compile.py does): Inductor's code generation costs minutes of CPU here
and is not what a family can get wrong (checked by hand: the real CLI run trains).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from mmtrain.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK_RUN = REPO / "configs" / "gpt" / "deepseek_v3_tiny_cpu_mock.yaml"


def _pretrain(rank: int, world_size: int, run_dir: str, overrides: list[str], backend: str | None):
    from torch._dynamo.utils import counters

    from mmtrain.pretrain_gpt import main

    if backend is not None:
        torch.compile = functools.partial(torch.compile, backend=backend)  # this process only
    counters.clear()
    code = main(["--config", str(DEEPSEEK_RUN), "train.steps=2", f"logging.run_dir={run_dir}", *overrides])
    return code, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_deepseek_v3_trains_with_compile(tmp_path):
    code, graphs, breaks = run_distributed(_pretrain, 1, str(tmp_path / "compiled"), ["train.compile=true"],
                                           "aot_eager")[0]
    assert code == 0 and graphs > 0 and breaks == 0  # it trained, through compiled graphs
    assert run_distributed(_pretrain, 1, str(tmp_path / "eager"), [], None)[0][0] == 0
    compiled, eager = _losses(tmp_path / "compiled"), _losses(tmp_path / "eager")
    assert len(compiled) == 2
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)
