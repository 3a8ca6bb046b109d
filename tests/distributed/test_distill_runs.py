"""Distillation through the training loop on gloo: a student of one shape from a teacher of another, on packed
documents (their loss mask), under TP2 with sequence parallelism (the KL on vocabulary-split logits, full and
top-k), PP2 and PP2 with virtual stages (the teacher whole on the last stage), DP2 with FSDP (the frozen teacher
sharded too) and CP2, each equal to one process; all the layouts run in one world-2 call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.schema import ModelConfig
from mmtrain.config.validate import validate_gpt_config
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.models.llama.model import GPTModel
from mmtrain.testing import run_distributed
from tests.data_helpers import write_text_dataset

LAYOUTS = {  # name: (overrides, which one-process run it equals)
    "tp2_sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], "full"),
    "tp2_top_k": (["parallel.tp=2", "distill.top_k=5"], "top_k"),
    "pp2": (["parallel.pp=2"], "full"),
    "pp2_vpp2": (["parallel.pp=2", "parallel.virtual_pp=2", "model.num_layers=4", "train.global_batch_size=8"],
                 "four_layers"),
    "dp2_fsdp": (["parallel.dp=2", "parallel.fsdp=true", "parallel.distributed_optimizer=true",
                  "train.micro_batch_size=1"], "full"),
    "cp2": (["parallel.cp=2"], "full"),
}

ONE_PROCESS = {"full": [], "top_k": ["distill.top_k=5"],
               "four_layers": ["model.num_layers=4", "train.global_batch_size=8"]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    data = write_text_dataset(folder / "web", num_docs=80, max_len=20, token_range=(1, 64), max_id=63)
    cfg = ModelConfig(num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, init_std=0.3)
    teacher = GPTModel(cfg)
    teacher.init_weights(7)
    write_weights_checkpoint(folder / "teacher", {k: v.detach().clone() for k, v in teacher.state_dict().items()},
                             cfg)
    return data, folder / "teacher"


def _overrides(data, teacher, run_dir, *extra):
    return [f"data.prefixes=[{data}]", "data.seq_length=16", "data.split=1,0,0", "data.reset_position_ids=true",
            "data.reset_attention_mask=true", "data.eod_mask_loss=true", "model.vocab_size=64",
            "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", "train.precision=fp32", "train.device=cpu", "train.steps=3",
            "train.micro_batch_size=2", "train.global_batch_size=4", "optim.lr=1e-2", "optim.warmup_steps=0",
            "train.objective=distill", f"distill.teacher={teacher}", "distill.temperature=2.0",
            "distill.alpha=0.7", f"logging.run_dir={run_dir}", *extra]


def _train(overrides: list[str], world_size: int) -> list[float]:
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


def _every_layout(rank, world_size, runs):
    return {name: _train(overrides, world_size) for name, overrides in runs.items()}


def test_layouts_equal_one_process(inputs, tmp_path):
    from mmtrain.parallel import init_distributed, shutdown_distributed

    data, teacher = inputs
    init_distributed()
    try:
        one = {kind: _train(_overrides(data, teacher, tmp_path / kind, *extra), 1) for kind, extra in ONE_PROCESS.items()}
    finally:
        shutdown_distributed()
    runs = {name: _overrides(data, teacher, tmp_path / name, *extra) for name, (extra, _) in LAYOUTS.items()}
    by_rank = run_distributed(_every_layout, 2, runs)
    assert one["top_k"] != one["full"]
    for name, (_, kind) in LAYOUTS.items():
        # every rank reports the reduced loss: the last stage's under PP, the mean over DP ranks' tokens
        for losses in by_rank:
            np.testing.assert_allclose(losses[name], one[kind], rtol=1e-4, err_msg=name)
