"""A training step reads nothing back from the device except at logging steps (issue #17): loss, token count,
grad norm, the NaN/Inf flag and the preemption flag stay on the device in between. On the CPU a read-back is no
real sync, so this counts the calls that would be one on a GPU (tests/gpu/test_host_syncs_gpu.py checks CUDA's
own sync detection)."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train import loop

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=10",
        "train.micro_batch_size=2", "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=4", "model.vocab_size=64", "checkpoint.save_final=false", "logging.log_every=5"]
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")  # a device read on a GPU


def _count_reads(rank: int, world_size: int, run_dir: str, extra: list[str], model_file: str | None = None,
                 base: list[str] = BASE):
    seen: list[tuple[int, str]] = []
    current = {"step": 0}
    step = loop._Run.step

    def counted_step(self, n):
        current["step"] = n
        return step(self, n)
    loop._Run.step = counted_step

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            seen.append((current["step"], name))
            return original(self, *args, **kwargs)
        return read
    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    if "train.precision=fp8" in extra:
        from mmtrain.model import fp8  # the build imports resolve_fp8_backend from it when it runs

        fp8.resolve_fp8_backend = lambda cfg, device: "native"  # the CPU stands in for the GPU (emulated FP8)
    cfg = load_config(GPTRunConfig, model_file, [*base, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = loop.train_gpt(cfg, mesh, torch.device("cpu"))
    return seen, result.losses


@pytest.mark.parametrize("extra", [[], ["optim.grad_clip=1e-3", "optim.master_weights=false"],
                                   ["train.precision=fp8", "fp8.recipe=delayed"]])
def test_no_device_reads_on_non_logging_steps(tmp_path, extra):
    seen, losses = run_distributed(_count_reads, 1, str(tmp_path), extra)[0]
    off_steps = [(s, name) for s, name in seen if s and s % 5]
    assert off_steps == [], f"device reads on non-logging steps: {off_steps[:10]}"
    assert {s for s, _ in seen if s} == {5, 10}  # the logging steps read the numbers of every step back
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10  # still one metrics row per step


MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.moe_router=sigmoid",
       "model.moe_shared_ffn_hidden_size=32", "model.moe_bias_update_rate=1e-3"]
DEEPSEEK = ("configs/models/deepseek-v3-tiny.yaml",
            [b for b in BASE if not b.startswith("model.")] + ["model.deepseek_v3.vocab_size=64"])


def _off_step_reads(seen) -> list[tuple[int, str]]:
    return [(s, name) for s, name in seen if s and s % 5]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_moe_reads_nothing_on_non_logging_steps(tmp_path, family):
    """MoE layers (router, local dispatch, grouped GEMM, router-bias balancing) keep their counts on the device."""
    model_file, base = DEEPSEEK if family == "deepseek_v3" else (None, BASE)
    extra = [] if family == "deepseek_v3" else MOE
    seen, losses = run_distributed(_count_reads, 1, str(tmp_path), extra, model_file, base)[0]
    assert _off_step_reads(seen) == []
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))


def test_ep2_padded_all_to_all_reads_nothing_on_non_logging_steps(tmp_path):
    """parallel.ep_dispatch=padded: fixed splits, so the expert-parallel exchange needs no counts on the host."""
    extra = [*MOE, "parallel.dp=2", "parallel.ep=2", "parallel.ep_dispatch=padded", "parallel.ep_overlap_shared=true"]
    for seen, losses in run_distributed(_count_reads, 2, str(tmp_path), extra):
        assert _off_step_reads(seen) == []
        assert len(losses) == 10


def test_ep2_exact_all_to_all_reads_the_split_sizes_once_per_layer(tmp_path):
    """parallel.ep_dispatch=exact (the default): all_to_all_single takes host split sizes, read back once per MoE
    layer and micro-batch (the documented sync), and nothing else."""
    extra = [*MOE, "parallel.dp=2", "parallel.ep=2"]
    for seen, _ in run_distributed(_count_reads, 2, str(tmp_path), extra):
        off = _off_step_reads(seen)
        assert {name for _, name in off} == {"tolist"}
        per_step = {s: sum(1 for t, _ in off if t == s) for s, _ in off}
        assert set(per_step) == {1, 2, 3, 4, 6, 7, 8, 9}
        assert len(set(per_step.values())) == 1 and next(iter(per_step.values())) % 2 == 0  # 2 MoE layers


def _reads_per_step(rank: int, world_size: int, run_dir: str) -> list[tuple[int, list[int]]]:
    reads: list[tuple[int, list[int]]] = []
    read_back = loop._Run._read_back

    def recorded(self, evaluate, keep_newest=False):
        before = [p.step for p in self.pending]
        read_back(self, evaluate, keep_newest)
        kept = {p.step for p in self.pending}
        reads.append((before[-1], [s for s in before if s not in kept]))
    loop._Run._read_back = recorded
    base = [b for b in BASE if not b.startswith(("logging.log_every", "train.steps"))]
    cfg = load_config(GPTRunConfig, None, [*base, "logging.log_every=1", "train.steps=6", "checkpoint.save_every=4",
                                           f"logging.run_dir={run_dir}"])
    loop.train_gpt(cfg, ParallelDims.from_config(cfg.parallel, 1).build(), torch.device("cpu"))
    return reads


def test_logging_every_step_reads_the_step_before_back(tmp_path):
    """At logging.log_every=1 a step reads the previous step's numbers, so the device keeps a step queued; a step
    that saves (4) or ends the run (6) reads its own too. Every step keeps its one row, in order."""
    reads = run_distributed(_reads_per_step, 1, str(tmp_path))[0]
    assert reads == [(1, []), (2, [1]), (3, [2]), (4, [3, 4]), (5, []), (6, [5, 6])]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["step_time_s"] > 0 for r in rows)
