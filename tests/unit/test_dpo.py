"""DPO: loss and gradients equal a direct fp64 computation of the formula; on a toy preference set the margin
grows; TP2 equals one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.data.preference_dataset import PreferencePairs
from mmtrain.models.llama.model import GPTModel
from mmtrain.train.dpo import dpo_losses, pair_inputs, sequence_logps
from tests.sft_helpers import build_chat_tokenizer

SEQ = 48


@pytest.fixture(scope="module")
def pref_prefix(tmp_path_factory):
    from dataprep.cli import main as prep

    folder = tmp_path_factory.mktemp("pref")
    tok = build_chat_tokenizer(folder / "tok")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and ran to the big red house".split()
    records = []
    for _ in range(16):
        prompt = " ".join(rng.choice(words, 4))
        records.append({"prompt": prompt, "chosen": "yes " + " ".join(rng.choice(words, 3)),
                        "rejected": "no " + " ".join(rng.choice(words, 3))})
    src = folder / "pref.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prep(["sft", "--preference", "--input", str(src), "--output-prefix", str(folder / "p"), "--tokenizer",
                 str(tok), "--chat-template", "chatml", "--workers", "0", "--progress", "never"]) == 0
    return folder / "p"


def _overrides(prefix, *extra):
    return ["train.objective=dpo", "data.type=preference", f"data.prefixes=[{prefix}]", f"data.seq_length={SEQ}",
            "data.split=1,0,0", "model.vocab_size=640", "model.num_layers=2", "model.hidden_size=32",
            "model.ffn_hidden_size=64", "model.num_attention_heads=4", "train.precision=fp32", "train.device=cpu",
            "dpo.beta=0.5", *extra]


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_loss_and_grads_equal_fp64_formula(pref_prefix, kind):
    cfg = load_config(GPTRunConfig, None, _overrides(pref_prefix))
    model = GPTModel(cfg.model)
    model.init_weights(3)
    pairs = PreferencePairs(str(pref_prefix), SEQ, seed=0, num_samples=4)
    batch = torch.stack([torch.as_tensor(pairs[i]) for i in range(4)])
    inputs, labels, positions, doc_ids, mask = pair_inputs(batch)
    beta = 0.5
    logps = sequence_logps(model(inputs, labels, positions, doc_ids), mask)
    # reference log-probs: constants near the policy's (as at the start of training), so h is of order 1
    ref = logps.detach().double() + torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    losses, _, _ = dpo_losses(logps[:4], logps[4:], ref[:4].float(), ref[4:].float(), beta, kind)
    losses.sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref64 = GPTModel(cfg.model).double()
    ref64.load_state_dict(model.state_dict())
    logits = ref64(inputs).double()  # (2B, S, V) full logits, fp64
    token_logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    seq = (token_logp * mask.double()).sum(-1)
    h = (seq[:4] - ref[:4]) - (seq[4:] - ref[4:])
    direct = torch.log1p(torch.exp(-beta * h)) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2
    direct.sum().backward()
    torch.testing.assert_close(losses.double(), direct.detach(), rtol=1e-5, atol=1e-5)
    for name, p in ref64.named_parameters():  # fp32 against fp64: relative to each gradient's norm
        error = (ours[name].double() - p.grad).norm() / p.grad.norm()
        assert error < 1e-4, (name, float(error))


def test_dpo_config_checks(pref_prefix):
    with pytest.raises(ConfigError, match="DPO trains on preference pairs"):
        validate_gpt_config(load_config(GPTRunConfig, None, _overrides(pref_prefix, "train.objective=lm")))
    with pytest.raises(ConfigError, match="parallel.cp > 1"):
        validate_gpt_config(load_config(GPTRunConfig, None, _overrides(pref_prefix, "parallel.cp=2")))


def _train(rank, world_size, overrides):
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


def test_toy_preferences_raise_the_margin_and_tp2_equals_one_process(pref_prefix, tmp_path):
    from mmtrain.testing import run_distributed

    common = _overrides(pref_prefix, "train.steps=6", "train.micro_batch_size=4", "train.eval_every=0",
                        "optim.warmup_steps=0", "optim.lr=5e-3", "logging.log_every=1")
    one = run_distributed(_train, 1, common + [f"logging.run_dir={tmp_path}/a"])[0]
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    margins = [r["reward_margin"] for r in rows]
    assert abs(margins[0]) < 1e-6 and abs(one[0] - np.log(2)) < 1e-5  # the policy starts as the reference
    assert margins[-1] > 0.5 and one[-1] < one[0] and rows[-1]["reward_accuracy"] == 1.0
    two = run_distributed(_train, 2, common + ["parallel.tp=2", f"logging.run_dir={tmp_path}/b"])[0]
    np.testing.assert_allclose(two, one, rtol=1e-4)
    # pipeline stages: the reference and the policy both run through the 1F1B / forward-only schedules
    staged = run_distributed(_train, 2, common + ["parallel.pp=2", "train.micro_batch_size=2",
                                                  "train.global_batch_size=4", f"logging.run_dir={tmp_path}/c"])
    np.testing.assert_allclose(staged[-1], one, rtol=1e-4)
