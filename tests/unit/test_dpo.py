"""DPO: loss and gradients equal a direct fp64 computation of the formula (sigmoid, IPO); IPO is TRL's
(length-normalized log-ratios); config checks. The training runs (margin grows, TP2 / PP2 equal one process) are
in tests/distributed/test_post_training_runs.py."""

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
    tokens = mask.sum(-1)
    losses, _, _ = dpo_losses(logps[:4], logps[4:], ref[:4].float(), ref[4:].float(), beta, kind, tokens[:4],
                              tokens[4:])
    losses.sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref64 = GPTModel(cfg.model).double()
    ref64.load_state_dict(model.state_dict())
    logits = ref64(inputs).double()  # (2B, S, V) full logits, fp64
    token_logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    seq = (token_logp * mask.double()).sum(-1)
    if kind == "sigmoid":
        h = (seq[:4] - ref[:4]) - (seq[4:] - ref[4:])
        direct = torch.log1p(torch.exp(-beta * h))
    else:  # each answer's log-ratio per loss token
        n = mask.double().sum(-1)
        h = (seq[:4] - ref[:4]) / n[:4] - (seq[4:] - ref[4:]) / n[4:]
        direct = (h - 1 / (2 * beta)) ** 2
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




def _trl_ipo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, len_chosen,
             len_rejected, beta):
    """TRL's DPOTrainer with loss_type="ipo", written out by hand (TRL is not installed here): its
    concatenated_forward divides each sequence's summed log-probs by its completion-mask length, for the policy
    and the reference alike, then dpo_loss takes logits = (pi_c - pi_r) - (ref_c - ref_r) and
    loss = (logits - 1 / (2 beta))^2; rewards are beta (pi - ref) of those averaged log-probs."""
    pi_c, pi_r = policy_chosen_logps / len_chosen, policy_rejected_logps / len_rejected
    ref_c, ref_r = ref_chosen_logps / len_chosen, ref_rejected_logps / len_rejected
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    return (logits - 1 / (2 * beta)) ** 2, beta * (pi_c - ref_c), beta * (pi_r - ref_r)


def test_ipo_equals_trls_length_normalized_loss():
    g = torch.Generator().manual_seed(1)
    len_c, len_r = torch.tensor([3, 17, 40, 8]), torch.tensor([12, 5, 40, 1])
    # summed log-probs of the sizes real answers have (about -1 per token)
    pc, rc = -len_c * (1 + torch.rand(4, generator=g, dtype=torch.float64)), -len_c * 1.2
    pr, rr = -len_r * (1 + torch.rand(4, generator=g, dtype=torch.float64)), -len_r * 1.1
    beta = 0.1
    want, want_c, want_r = _trl_ipo(pc, pr, rc, rr, len_c.double(), len_r.double(), beta)
    got, got_c, got_r = dpo_losses(pc, pr, rc, rr, beta, "ipo", len_c, len_r)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close((got_c, got_r), (want_c, want_r), rtol=1e-12, atol=0)
    summed = ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2  # the summed-log-prob IPO: another loss
    assert not torch.allclose(summed, want)
    with pytest.raises(ValueError, match="loss-token count"):
        dpo_losses(pc, pr, rc, rr, beta, "ipo")


def test_dpo_step_passes_each_answers_loss_tokens_to_ipo(pref_prefix):
    """run_dpo_micro_batches (the training step, precomputed reference table) gives TRL's IPO loss."""
    from mmtrain.train.dpo import run_dpo_micro_batches

    cfg = load_config(GPTRunConfig, None, _overrides(pref_prefix, "dpo.loss=ipo", "dpo.beta=0.1"))
    model = GPTModel(cfg.model)
    model.init_weights(3)
    pairs = PreferencePairs(str(pref_prefix), SEQ, seed=0, num_samples=4, with_index=True)
    batch = torch.stack([torch.as_tensor(pairs[i]) for i in range(4)])
    table = torch.randn(len(pairs.chosen.order), 2, generator=torch.Generator().manual_seed(2),
                        dtype=torch.float64) - 20.0

    def one_by_one(step, n, module, mesh, cfg, device, buckets, shape):
        for i in range(n):
            step(i, None)

    with torch.no_grad():
        stats = run_dpo_micro_batches(model, None, [batch], None, cfg, torch.device("cpu"), None, one_by_one, table)
        inputs, labels, positions, doc_ids, mask = pair_inputs(batch)
        logps = sequence_logps(model(inputs, labels, positions, doc_ids), mask).double()
    index = batch[:, 8, 0]
    tokens = mask.double().sum(-1)
    want, _, _ = _trl_ipo(logps[:4], logps[4:], table[index, 0], table[index, 1], tokens[:4], tokens[4:], 0.1)
    assert float(stats[1]) == 4
    torch.testing.assert_close(float(stats[0]), float(want.sum()), rtol=1e-5, atol=1e-6)
