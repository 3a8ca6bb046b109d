"""Native FP8 under tensor (+ sequence) parallelism equals one process (CPU, gloo, fp32 weights, FP8 GEMMs through
torch._scaled_mm on the CPU): with delayed scaling every amax is reduced over TP, so each logical tensor has
one scale on every rank, the same as without TP (weights: one amax reduced over TP at each re-cast); and the
training loop runs FP8 end to end, tracking BF16's losses."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import capture_log_messages, run_distributed

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=64", "data.mock=true", "data.seq_length=16"]


def _two_steps(rank: int, world_size: int, recipe: str, sp: bool, head: bool = False):
    from mmtrain.model.fp8 import Fp8Runtime, apply_native_fp8
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.parallel.tensor import (
        allreduce_tp_partial_grads,
        apply_tensor_parallel,
    )

    extra = [f"parallel.tp={world_size}", f"parallel.sequence_parallel={str(sp).lower()}"]
    cfg = load_config(GPTRunConfig, None, [*MODEL, "train.precision=fp8", f"fp8.recipe={recipe}", *extra,
                                           f"fp8.output_layer={str(head).lower()}"])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    model = GPTModel(cfg.model)
    model.init_weights(3)
    apply_tensor_parallel(model, mesh.tp_group, sp)
    apply_native_fp8(model, cfg)
    rt = Fp8Runtime("native", cfg, [model], mesh.tp_group)
    rt.weights_changed()
    for m in rt.matmuls if recipe == "delayed" else ():  # the same first-step scales in every layout
        m.scales.copy_(torch.tensor([32.0, 4096.0]))
        m.delayed_ready = True
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], ids[:, 1:]).sum()
        loss.backward()
        rt.after_backward([mesh.tp_group])
        losses.append(loss.item())
    scales = [m.scales.clone() for m in rt.matmuls] if recipe == "delayed" else []
    allreduce_tp_partial_grads(model, mesh.tp_group)  # norm weights under SP: each rank holds a partial sum
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, scales, grads, mesh.coord.tp


@pytest.fixture(scope="module")
def single():
    return {head: run_distributed(_two_steps, 1, "delayed", False, head)[0] for head in (False, True)}


@pytest.mark.parametrize("head", [False, True], ids=["bf16-head", "fp8-head"])
def test_tp2_sp_delayed_scaling_equals_one_process(single, head):
    """TP2 with sequence parallelism (column: all-gather of the input, row: reduce-scatter of the output); with
    ``fp8.output_layer`` the vocabulary-parallel head too (its logits-gradient amax is reduced over TP)."""
    sp = True
    ref_losses, ref_scales, ref_grads, _ = single[head]
    cfg = load_config(GPTRunConfig, None, MODEL)
    outs = run_distributed(_two_steps, 2, "delayed", sp, head)
    assert len(ref_scales) == 8 + head
    for losses, scales, grads, tp_rank in outs:
        # step 2 casts with the scales from step 1's amaxes, reduced over TP: one scale per logical tensor
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for got, want in zip(scales, ref_scales):
            assert torch.allclose(got, want, rtol=1e-6)
        for name, g in grads.items():
            want = tp_shard_of(name, ref_grads[name], llama_sharding_spec(cfg.model), tp_rank, 2)
            assert torch.allclose(g, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), name


def _train_bf16_then_fp8(rank: int, world_size: int, run_dir: str):
    from mmtrain.model import fp8  # the build imports resolve_fp8_backend from it when it runs
    from mmtrain.train.loop import train_gpt

    fp8.resolve_fp8_backend = lambda cfg, device: "native"  # the CPU stands in for the GPU (emulated FP8)
    records = capture_log_messages()
    losses = []
    for precision in ("bf16", "fp8"):
        cfg = load_config(GPTRunConfig, None, [
            *MODEL, "train.device=cpu", "train.steps=6", "train.micro_batch_size=2", "train.global_batch_size=8",
            "optim.lr=3e-3", "optim.warmup_steps=1", f"logging.run_dir={run_dir}/{precision}",
            "checkpoint.save_final=false", "parallel.dp=2", f"train.precision={precision}", "fp8.recipe=delayed"])
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
        losses.append(train_gpt(cfg, mesh, torch.device("cpu")).losses)
    return losses, [m for m in records if m.startswith("fp8:")]


def test_training_loop_runs_fp8_and_tracks_bf16(tmp_path):
    """DP2 with 2 micro-batches per rank: delayed scaling's amaxes are the max over micro-batches and ranks."""
    (bf16, fp8), lines = run_distributed(_train_bf16_then_fp8, 2, str(tmp_path))[0]
    assert lines and "backend native, recipe delayed" in lines[0]
    assert all(abs(a - b) / b < 0.02 for a, b in zip(fp8, bf16)), (fp8, bf16)
