"""GRPO's arithmetic, as TRL 1.16's ``GRPOTrainer`` defines it (``_generate_and_score_completions`` and
``_compute_loss``, token-level importance sampling, one reward function): group-normalized advantages, the
clipped per-token objective with the k3 KL estimator, and the aggregation of token losses by ``loss_type``.

Per completion token t with log-probs ``logp`` (policy), ``old`` (the policy that sampled it) and ``ref``:
``ratio = exp(logp - old)``; ``loss_t = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + beta kl_t`` with
``kl_t = exp(ref - logp) - (ref - logp) - 1``. The loop divides the summed loss by a count summed over the
global batch, so each ``loss_type`` is a (sum, count) pair per micro-batch: dapo (sum of token losses, tokens),
grpo (sum over completions of their token mean, completions), dr_grpo (sum, completions x max_new_tokens), bnpo
(the micro-batch's token mean, 1). These equal TRL's losses for its global batch (tests/unit/test_grpo_loss.py
runs TRL's own ``_compute_loss`` on the same log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-4  # TRL's: added to the group's standard deviation


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each group's standard deviation == 0) of ``rewards`` (groups of ``group_size`` consecutive
    completions): reward - group mean, divided by the group's standard deviation (unbiased, as TRL's ``nanstd``)
    + 1e-4 when ``scale`` is "group"; not divided when it is "none"."""
    grouped = rewards.double().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)  # unbiased (n - 1)
    advantages = grouped - mean
    if scale == "group":
        advantages = advantages / (std + ADVANTAGE_EPS)
    elif scale != "none":
        raise ValueError(f"scale_rewards={scale!r}; expected group or none")
    return advantages.reshape(-1).to(rewards.dtype), torch.isclose(std[:, 0], torch.zeros_like(std[:, 0]))


@dataclass
class TokenLosses:
    """The per-token terms of one micro-batch, (B, T): the loss, the KL (None without a reference) and the ratio."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    ratio: torch.Tensor


def token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, epsilon: float,
                 epsilon_high: float, beta: float = 0.0, ref_logp: torch.Tensor | None = None) -> TokenLosses:
    """The clipped objective per token (module docstring); ``advantages`` (B,), the log-probs (B, T)."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    a = advantages[:, None].to(ratio.dtype)
    loss = -torch.min(ratio * a, clipped * a)
    kl = None
    if beta != 0.0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        loss = loss + beta * kl
    return TokenLosses(loss, kl, ratio)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_new_tokens: int
              ) -> tuple[torch.Tensor, float | torch.Tensor]:
    """(sum, count) of one micro-batch for ``loss_type``: the global loss is the sum over micro-batches and
    ranks of the sums divided by that of the counts (module docstring)."""
    masked = loss * mask
    if loss_type == "dapo":
        return masked.sum(), mask.sum()
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), float(loss.shape[0])
    if loss_type == "dr_grpo":
        return masked.sum(), float(loss.shape[0] * max_new_tokens)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), 1.0
    raise ValueError(f"grpo.loss_type={loss_type!r}; expected dapo, grpo, dr_grpo or bnpo")


def clip_counts(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float,
                epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion tokens whose ratio is clipped below (ratio < 1 - eps with A < 0) and above (ratio > 1 +
    eps_high with A > 0): TRL's clip_ratio/low and /high numerators."""
    a = advantages[:, None]
    low = ((ratio < 1 - epsilon) & (a < 0)).to(mask.dtype) * mask
    high = ((ratio > 1 + epsilon_high) & (a > 0)).to(mask.dtype) * mask
    return low.sum(), high.sum()
