"""No host sync on a non-logging step, by CUDA's own detection (skipped without CUDA): steps 2..N that are not
logging steps run under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call
(``.item()``, a blocking device-to-host copy, ``nonzero``, ...). Step 1 is left out: first-step set-up (optimizer
state, FP8 buffer sizing, compile) may sync once."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims, init_distributed
from mmtrain.train import loop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BASE = ["data.mock=true", "data.seq_length=256", "train.device=cuda", "train.steps=8", "train.micro_batch_size=2",
        "checkpoint.save_final=false", "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512",
        "model.num_attention_heads=4", "model.vocab_size=1024", "logging.log_every=4",
        "train.global_batch_size=4"]


@pytest.fixture(scope="module")
def mesh():
    init_distributed("nccl", torch.device("cuda", 0))
    return ParallelDims(world_size=1).build()


@pytest.mark.parametrize("extra", [["train.precision=bf16"], ["train.precision=bf16", "optim.master_weights=false"],
                                   # packed documents: FlexAttention's block mask built from each micro-batch's
                                   # document ids on the device (issue #32's packed row)
                                   ["train.precision=bf16", "data.reset_position_ids=true",
                                    "data.reset_attention_mask=true", "data.eod_mask_loss=true"],
                                   ["train.precision=fp8", "fp8.backend=native"],
                                   # MoE (local dispatch, grouped GEMM on 9.0+, sigmoid router with bias balancing)
                                   ["train.precision=bf16", "model.num_experts=4", "model.moe_top_k=2",
                                    "model.moe_ffn_hidden_size=256", "model.moe_router=sigmoid",
                                    "model.moe_shared_ffn_hidden_size=256", "model.moe_bias_update_rate=1e-3"]])
def test_non_logging_steps_do_not_sync(tmp_path, mesh, extra, monkeypatch):
    if "train.precision=fp8" in extra and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    if "model.num_experts=4" in extra and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the per-expert loop without grouped GEMM (before 9.0) reads the counts back")
    step = loop._Run.step
    checked = []

    def step_under_sync_detection(self, n):
        strict = n > 1 and n % 4 != 0 and n != self.cfg.train.steps
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            return step(self, n)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            if strict:
                checked.append(n)
    monkeypatch.setattr(loop._Run, "step", step_under_sync_detection)
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={tmp_path}", *extra])
    result = loop.train_gpt(cfg, mesh, torch.device("cuda", 0))
    assert checked == [2, 3, 5, 6, 7]
    assert len(result.losses) == 8 and all(torch.isfinite(torch.tensor(result.losses)))


def test_reading_a_step_back_does_not_wait_for_the_steps_queued_after_it():
    """``PendingStep.read`` waits for its own step's copy only: with a long kernel queued after it, the read
    returns while that kernel still runs (a plain ``.tolist()`` would wait for it)."""
    from mmtrain.train.step_readout import PendingStep, StepClock, queue_readout

    clock = StepClock(torch.device("cuda"))
    began = clock.begin()
    stats = torch.tensor([6.0, 3.0, 5.0], dtype=torch.float64, device="cuda")
    values, ready = queue_readout(stats[0] / stats[1], torch.tensor(1.5, device="cuda"),
                                  torch.tensor(True, device="cuda"), stats)
    pending = PendingStep(1, 0.1, stats[0], values, ready, began, clock.end(), [])
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued behind the step
    (loss, grad_norm, finite), step_stats = pending.read()
    assert not torch.cuda.current_stream().query(), "the read waited for the kernel queued after the step"
    assert (loss, grad_norm, finite) == (2.0, 1.5, 1.0) and step_stats.tolist() == [6.0, 3.0, 5.0]
    assert clock.seconds(pending.began, pending.ended) >= 0
    torch.cuda.synchronize()


def test_a_batch_copy_from_pageable_memory_does_not_wait_for_the_gpu():
    """``to_device`` stages a pageable tensor in pinned memory: the copy is queued behind a long kernel instead of
    waiting for it (CUDA syncs the stream before a plain copy from pageable memory)."""
    from mmtrain.utils.host_copy import to_device

    src = torch.arange(1 << 20, dtype=torch.int64)  # pageable
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a ~1 s kernel on the current stream
    out = to_device(src, torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the copy waited for the queued kernel"
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src)
    rows = torch.arange(8).expand(4, 8)  # an expanded (stride-0) tensor, as GPTMicroBatch.plain's positions
    assert torch.equal(to_device(rows, torch.device("cuda")).cpu(), rows)
