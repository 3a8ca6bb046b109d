"""GRPO's loss equals TRL's: TRL 1.16's own ``GRPOTrainer._compute_loss`` runs on the same token log-probs,
advantages and masks (a stand-in ``self`` holds the settings it reads and hands it the log-probs; no model, no
trainer), and its loss, its gradient with respect to the log-probs and its logged KL and clip ratios are compared
with ``mmtrain.train.grpo_loss`` for every loss type we offer, with and without the KL term, on the step that
generated (pi_old = the detached policy) and on a later iteration (pi_old given, ratios clipped). The
advantages equal TRL's group normalization (its ``nanstd``)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mmtrain.config.grpo_schema import GRPO_LOSS_TYPES
from mmtrain.train.grpo_loss import aggregate, clip_counts, group_advantages, token_losses

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

B, T, MAX_NEW = 6, 7, 9


def _trl_self(loss_type: str, beta: float, epsilon: float, epsilon_high: float, logp: torch.Tensor):
    """The attributes ``_compute_loss`` reads, one process, no gradient accumulation, token-level ratios."""
    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logp, torch.zeros_like(logp), None

    accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                  gather_for_metrics=lambda x: x)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon_high, use_vllm=False, vllm_importance_sampling_correction=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, max_completion_length=MAX_NEW,
        _metrics=defaultdict(lambda: defaultdict(list)))


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside 1 +- 0.2
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return logp, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("first_iteration", [True, False])
def test_loss_gradient_and_metrics_equal_trls(loss_type, beta, first_iteration):
    logp0, old, ref, advantages, mask = _case(3)
    eps, eps_high = 0.2, 0.28
    theirs_logp = logp0.clone().requires_grad_(True)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    if not first_iteration:
        inputs["old_per_token_logps"] = old
    trl_self = _trl_self(loss_type, beta, eps, eps_high, theirs_logp)
    theirs = trl_grpo.GRPOTrainer._compute_loss(trl_self, None, inputs)
    theirs.backward()

    ours_logp = logp0.clone().requires_grad_(True)
    terms = token_losses(ours_logp, ours_logp.detach() if first_iteration else old, advantages, eps, eps_high, beta,
                         ref)
    total, count = aggregate(terms.loss, mask, loss_type, MAX_NEW)
    ours = total / count
    ours.backward()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=1e-12, atol=1e-12)
    metrics = trl_self._metrics["train"]  # TRL counts the tokens of its logged means in fp32
    low, high = clip_counts(terms.ratio.detach(), advantages, mask, eps, eps_high)
    assert metrics["clip_ratio/low_mean"][0] == pytest.approx(float(low / mask.sum()), rel=1e-6)
    assert metrics["clip_ratio/high_mean"][0] == pytest.approx(float(high / mask.sum()), rel=1e-6)
    assert metrics["clip_ratio/region_mean"][0] == pytest.approx(float((low + high) / mask.sum()), rel=1e-6)
    if not first_iteration:
        assert 0 < float(low + high) < float(mask.sum())  # some ratios clipped, not all: the clip is exercised
    if beta:
        assert metrics["kl"][0] == pytest.approx(float((terms.kl.detach() * mask).sum() / mask.sum()), rel=1e-6)


def test_advantages_equal_trls_group_normalization():
    from trl.trainer.utils import nanstd

    G = 4
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.1, 0.9, 0.3, 0.0], dtype=torch.float64)
    ours, zero_std = group_advantages(rewards, G, "group")
    mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)  # TRL's lines, scale_rewards="group"
    # its Bessel factor count / (count - 1) is a float32 division: equal to its precision
    torch.testing.assert_close(ours, (rewards - mean) / (std + 1e-4), rtol=1e-6, atol=1e-9)
    assert zero_std.tolist() == [False, True, False]
    torch.testing.assert_close(group_advantages(rewards, G, "none")[0], rewards - mean)
