"""``fp8.param_gather`` (CPU, gloo, 4 ranks: 2 data-parallel x TP2 with sequence parallelism, distributed optimizer,
native FP8 emulated on the CPU, the FP8 output layer on): gathering the FP8 linears' weights in FP8 gives the
same FP8 weight copies, bit for bit, as gathering BF16 and casting (weight amaxes reduced over DP and TP); the
same losses and gradients; whole BF16 weights after the on-demand BF16 gather. Delayed scaling: an exact resume
(amax histories and scales in the checkpoint, saved asynchronously), and a resume at another layout (PP2 x TP2)
restoring them by name."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import capture_log_messages, run_distributed

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=64", "data.mock=true", "data.seq_length=16"]
RUN = [*MODEL, "train.device=cpu", "train.steps=4", "train.micro_batch_size=2", "train.global_batch_size=8",
       "optim.lr=3e-3", "optim.warmup_steps=1", "checkpoint.save_final=false", "parallel.dp=2", "parallel.tp=2",
       "parallel.sequence_parallel=true",
       "train.precision=fp8", "fp8.recipe=delayed", "fp8.amax_history_len=3",  # shorter than the run: a ring
       "fp8.output_layer=true"]  # untied: the head is FP8-gathered too
FP8_COPIES = ("w_a", "w_b", "w_a_inv", "w_b_inv")


def _runs(rank: int, world_size: int, run_dir: str):
    from mmtrain.model import fp8  # the build imports resolve_fp8_backend from it when it runs
    from mmtrain.train.loop import train_gpt

    fp8.resolve_fp8_backend = lambda cfg, device: "native"  # the CPU stands in for the GPU (emulated FP8)
    lines = capture_log_messages()
    runs = {"bf16_gather": ["fp8.param_gather=false"],
            "fp8_gather": ["fp8.param_gather=true", "checkpoint.save_every=2", "checkpoint.async_save=true"],
            "resumed": ["fp8.param_gather=true", f"checkpoint.load={run_dir}/fp8_gather/checkpoints/step_00000002"],
            "resharded": ["parallel.dp=1", "parallel.pp=2",
                          f"checkpoint.load={run_dir}/fp8_gather/checkpoints/step_00000002"]}
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
            "delayed": {n: {k: v.clone() for k, v in d.items()} for n, d in rt.delayed_state().items()},
            "log": [m for m in lines if m.startswith("fp8: backend")],
            "restore_log": sorted({m for m in lines if m.startswith("fp8: ") and not m.startswith("fp8: backend")})}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_runs, 4, str(tmp_path_factory.mktemp("pg")))


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


def test_delayed_scaling_resumes_exactly_and_reshards_by_name(runs):
    for rank, out in enumerate(runs):
        full, resumed, resharded = out["fp8_gather"], out["resumed"], out["resharded"]
        assert len(resumed["restore_log"]) == 1 and "restored the amax history and scales of 9" in \
            resumed["restore_log"][0]
        assert resumed["losses"] == full["losses"][2:]  # bit for bit
        assert resumed["delayed"].keys() == full["delayed"].keys() and len(full["delayed"]) == 9
        for name, state in full["delayed"].items():
            for k, v in state.items():
                assert torch.equal(resumed["delayed"][name][k], v), (rank, name, k)
        # PP2 x TP2: stage 0 has layer 0's four FP8 linears, stage 1 layer 1's and the head
        stage = rank // 2
        assert resharded["restore_log"] == [resharded["restore_log"][0]] and \
            f"of {4 + stage} FP8 matmul(s)" in resharded["restore_log"][0]
        assert set(resharded["delayed"]) == {n for n in full["delayed"] if n.startswith(f"layers.{stage}.")
                                             or (stage == 1 and n == "head")}
        assert resharded["losses"] == pytest.approx(full["losses"][2:], rel=1e-2)
        for name, state in resharded["delayed"].items():  # steps 2-4: 2 restored, 3-4 this layout's own amaxes
            assert torch.allclose(state["amax_history"], full["delayed"][name]["amax_history"], rtol=0.05), name
