"""``fp8.param_gather`` (CPU, gloo, 4 ranks: 2 data-parallel x TP2 with sequence parallelism, distributed optimizer,
native FP8 emulated on the CPU, the FP8 output layer on): gathering the FP8 linears' weights in FP8 gives the
same FP8 weight copies, bit for bit, as gathering BF16 and casting (weight amaxes reduced over DP and TP); the
same losses and gradients; whole BF16 weights after the on-demand BF16 gather; an exact resume."""

from __future__ import annotations

import logging

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=64", "data.mock=true", "data.seq_length=16"]
RUN = [*MODEL, "train.device=cpu", "train.steps=4", "train.micro_batch_size=2", "train.global_batch_size=8",
       "optim.lr=3e-3", "optim.warmup_steps=1", "checkpoint.save_final=false", "parallel.dp=2", "parallel.tp=2",
       "parallel.sequence_parallel=true",
       "train.precision=fp8", "fp8.recipe=tensorwise",  # delayed: its amax history restarts at a resume
       "fp8.output_layer=true"]  # untied: the head is FP8-gathered too
FP8_COPIES = ("w_a", "w_b", "w_a_inv", "w_b_inv")


def _three_runs(rank: int, world_size: int, run_dir: str):
    from mmtrain.train import build
    from mmtrain.train.loop import train_gpt

    build.resolve_fp8_backend = lambda cfg, device: "native"  # the CPU stands in for the GPU (emulated FP8)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    for name in ["", *logging.root.manager.loggerDict]:
        logging.getLogger(name).addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    runs = {"bf16_gather": ["fp8.param_gather=false"],
            "fp8_gather": ["fp8.param_gather=true", "checkpoint.save_every=2"],
            "resumed": ["fp8.param_gather=true", f"checkpoint.load={run_dir}/fp8_gather/checkpoints/step_00000002"]}
    out = {}
    for name, extra in runs.items():
        lines.clear()
        cfg = load_config(GPTRunConfig, None, [*RUN, *extra, f"logging.run_dir={run_dir}/{name}"])
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
        result = train_gpt(cfg, mesh, torch.device("cpu"))
        model, rt = result.model, result.model.fp8_runtime
        names = {id(m): n for n, m in model.named_modules()}
        gather = rt.param_gather
        # the copies the next forward would use: without the FP8 gather they are cast from BF16 only then
        rt.refresh([m for m in rt.matmuls if m.weight_stale])
        out[name] = {
            "losses": result.losses, "grad_norms": result.grad_norms,
            "fp8": {names[id(m)]: [getattr(m, k).float().clone() for k in FP8_COPIES] for m in rt.matmuls},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
            "gathers": None if gather is None else (gather.fp8_gathers, gather.bf16_gathers, len(gather.matmuls)),
            "log": [m for m in lines if m.startswith("fp8:")]}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_three_runs, 4, str(tmp_path_factory.mktemp("pg")))


def test_fp8_gather_equals_bf16_gather_bit_for_bit(runs):
    for rank, out in enumerate(runs):
        ref, got = out["bf16_gather"], out["fp8_gather"]
        assert got["gathers"] == (4, 2, 9)  # every step in FP8; BF16 only for the saves (steps 2 and 4)
        assert "all-gathered in FP8 over 2 data-parallel ranks" in got["log"][0] and ref["gathers"] is None
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        for name, copies in ref["fp8"].items():  # the last step's copies, FP8-gathered vs cast from BF16
            for k, a, b in zip(FP8_COPIES, got["fp8"][name], copies):
                assert torch.equal(a, b), (rank, name, k)
        for name, p in ref["params"].items():  # BF16 weights after gather_full_params at the end of the run
            assert torch.equal(got["params"][name], p), (rank, name)
        for name, g in ref["grads"].items():
            assert torch.allclose(got["grads"][name], g, rtol=1e-5, atol=1e-7), (rank, name)


def test_fp8_gather_resumes_exactly(runs):
    for out in runs:
        assert out["resumed"]["losses"] == out["fp8_gather"]["losses"][2:]
        for name, copies in out["fp8_gather"]["fp8"].items():
            for a, b in zip(out["resumed"]["fp8"][name], copies):
                assert torch.equal(a, b), name
