"""A tiny student distilled on the demo corpus ends closer to its teacher's loss than the same student trained on
the hard labels alone (the same data, steps and seeds), on the CPU in seconds. The losses are those
``mmtrain.evaluate`` reports for the three checkpoints, on the valid split."""

from __future__ import annotations

import pytest
import torch

from dataprep.cli import main as prep_main
from dataprep.samples import write_sample_jsonl
from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config

COMMON = ["data.seq_length=64", "data.split=90,10,0", "data.reset_position_ids=true", "data.reset_attention_mask=true",
          "data.eod_mask_loss=true", "model.vocab_size=512", "train.precision=fp32", "train.device=cpu",
          "train.micro_batch_size=8", "optim.warmup_steps=3", "logging.log_every=10", "checkpoint.save_final=true"]
TEACHER = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.num_attention_heads=4",
           "model.num_query_groups=2", "train.steps=60", "optim.lr=1e-2"]
STUDENT = ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
           "model.num_query_groups=2", "train.steps=25", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The demo's sample corpus, its tokenizer and shards (mmtrain-prep, as the demo runs it)."""
    folder = tmp_path_factory.mktemp("demo")
    write_sample_jsonl(folder / "raw" / "web.jsonl", 1500, seed=1)
    assert prep_main(["train-tokenizer", "--input", str(folder / "raw"), "--output-prefix", str(folder / "tok/sp"),
                      "--vocab-size", "512"]) == 0
    assert prep_main(["text", "--input", str(folder / "raw/web.jsonl"), "--output-prefix", str(folder / "web"),
                      "--tokenizer", str(folder / "tok/sp.model"), "--append-eod", "--workers", "1"]) == 0
    return folder


def _train(overrides):
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, 1)
    train_gpt(cfg, ParallelDims.from_config(cfg.parallel, 1).build(), torch.device("cpu"))


def _valid_loss(ckpt, data) -> float:
    from mmtrain.evaluate import eval_run_config, evaluate_checkpoint
    from mmtrain.parallel import ParallelDims

    cfg = eval_run_config(ckpt, str(data), batch_size=8, device="cpu")
    return evaluate_checkpoint(cfg, ParallelDims(1).build(), torch.device("cpu"), ckpt).loss


def test_distilled_student_ends_closer_to_its_teacher(corpus, tmp_path):
    from mmtrain.parallel import init_distributed, shutdown_distributed
    from mmtrain.train.distill_teacher import check_teacher

    data = [f"data.prefixes=[{corpus / 'web'}]"]
    teacher, plain, distilled = tmp_path / "teacher", tmp_path / "plain", tmp_path / "distilled"
    kd = ["train.objective=distill", f"distill.teacher={teacher / 'checkpoints'}"]
    init_distributed()
    try:
        _train(COMMON + data + TEACHER + [f"logging.run_dir={teacher}"])
        check_teacher(load_config(GPTRunConfig, None, COMMON + data + STUDENT + kd))  # the same tokenizer
        _train(COMMON + data + STUDENT + [f"logging.run_dir={plain}"])
        _train(COMMON + data + STUDENT + kd + [f"logging.run_dir={distilled}"])
        losses = {run.name: _valid_loss(run / "checkpoints", corpus / "web") for run in (teacher, plain, distilled)}
    finally:
        shutdown_distributed()
    assert losses["teacher"] < losses["distilled"] < losses["plain"] - 0.05, losses
