"""Post-training runs through the training loop on gloo: SFT at one process equals DP2; DPO on a toy preference set
raises the margin, and TP2 / PP2 / DP2 / FSDP at DP2 equal one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.testing import run_distributed
from tests.sft_helpers import build_chat_tokenizer, toy_conversations, write_preference_dataset, write_sft_dataset
from tests.unit.test_dpo import _overrides as _dpo_overrides
from tests.unit.test_sft_training import _overrides


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    return write_sft_dataset(folder, build_chat_tokenizer(folder / "tok"), toy_conversations(24))


@pytest.fixture(scope="module")
def pref_prefix(tmp_path_factory):
    return write_preference_dataset(tmp_path_factory.mktemp("pref"))


def _train(rank, world_size, overrides):
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


def test_sft_run_one_process_equals_dp2(sft_prefix, tmp_path):
    common = _overrides(sft_prefix, "train.steps=3", "train.global_batch_size=4", "train.eval_every=0",
                        "optim.warmup_steps=0", "optim.lr=1e-2")
    one = run_distributed(_train, 1, common + ["train.micro_batch_size=4", f"logging.run_dir={tmp_path}/a"])[0]
    two = run_distributed(_train, 2, common + ["train.micro_batch_size=2", f"logging.run_dir={tmp_path}/b"])[0]
    assert len(one) == 3 and one[-1] < one[0]
    np.testing.assert_allclose(two, one, rtol=1e-5)


def _train_dpo(rank, world_size, overrides):
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


def test_toy_preferences_raise_the_margin_and_tp2_equals_one_process(pref_prefix, tmp_path):
    common = _dpo_overrides(pref_prefix, "train.steps=6", "train.micro_batch_size=4", "train.eval_every=0",
                        "optim.warmup_steps=0", "optim.lr=5e-3", "logging.log_every=1")
    one = run_distributed(_train_dpo, 1, common + [f"logging.run_dir={tmp_path}/a"])[0]
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    margins = [r["reward_margin"] for r in rows]
    assert abs(margins[0]) < 1e-6 and abs(one[0] - np.log(2)) < 1e-5  # the policy starts as the reference
    assert margins[-1] > 0.5 and one[-1] < one[0] and rows[-1]["reward_accuracy"] == 1.0
    two = run_distributed(_train_dpo, 2, common + ["parallel.tp=2", f"logging.run_dir={tmp_path}/b"])[0]
    np.testing.assert_allclose(two, one, rtol=1e-4)
    # pipeline stages: the reference and the policy both run through the 1F1B / forward-only schedules
    staged = run_distributed(_train_dpo, 2, common + ["parallel.pp=2", "train.micro_batch_size=2",
                                                  "train.global_batch_size=4", f"logging.run_dir={tmp_path}/c"])
    np.testing.assert_allclose(staged[-1], one, rtol=1e-4)
    # data parallel: the loss is the mean over all ranks' pairs
    split = run_distributed(_train_dpo, 2, common + ["parallel.dp=2", "train.micro_batch_size=2",
                                                     "train.global_batch_size=4", f"logging.run_dir={tmp_path}/d"])
    np.testing.assert_allclose(split[0], one, rtol=1e-4)
    # fully sharded: the policy's blocks and the frozen reference's are gathered per use
    sharded = run_distributed(_train_dpo, 2, common + ["parallel.dp=2", "parallel.fsdp=true", "train.micro_batch_size=2",
                                                       "train.global_batch_size=4", f"logging.run_dir={tmp_path}/e"])
    np.testing.assert_allclose(sharded[0], one, rtol=1e-4)
