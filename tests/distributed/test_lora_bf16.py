"""A bf16 LoRA run: the frozen base computes in bf16 like the adapters (before, the base stayed fp32 and the
first bf16 activation met an fp32 weight: "expected mat1 and mat2 to have the same dtype", seen on the H200)."""

from __future__ import annotations

import math

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=bf16", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "model.num_layers=2", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.vocab_size=64", "peft.lora.rank=4", "peft.lora.alpha=8", "train.eval_every=0"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    result = train_gpt(cfg, ParallelDims.from_config(cfg.parallel, world_size).build(), torch.device("cpu"))
    return result.losses, {(p.requires_grad, p.dtype) for p in result.model.parameters()}


@pytest.mark.parametrize("extra", [[], ["peft.lora.dora=true"]], ids=["lora", "dora"])
def test_bf16_lora_trains_with_the_frozen_base_in_bf16(tmp_path, extra):
    losses, kinds = run_distributed(_train, 1, str(tmp_path), extra)[0]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert kinds == {(False, torch.bfloat16), (True, torch.bfloat16)}  # fp32 masters live in the optimizer
