"""DPO: loss and gradients equal a direct fp64 computation of the formula (sigmoid, IPO); config checks. The
training runs (margin grows, TP2 / PP2 equal one process) are in tests/distributed/test_post_training_runs.py."""

from __future__ import annotations


import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.data.preference_dataset import PreferencePairs
from mmtrain.models.llama.model import GPTModel
from mmtrain.train.dpo import dpo_losses, pair_inputs, sequence_logps
from tests.sft_helpers import write_preference_dataset

SEQ = 48


@pytest.fixture(scope="module")
def pref_prefix(tmp_path_factory):
    return write_preference_dataset(tmp_path_factory.mktemp("pref"))


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


