"""Group relative policy optimization (``train.objective=grpo``; Shao et al. 2024, as TRL's ``GRPOTrainer``) on the
shared step loop: each step's prompts are completed by the policy itself (``grpo_rollouts``), and the step trains
on those completions with the clipped objective of ``grpo_loss``.

A step (``GrpoStep.forward_backward``): the rank's prompts of every micro-batch completed ``group_size`` times
at once through the decode engine on the training stage; the reference's token log-probs (``grpo.beta > 0``: a
frozen copy built as DPO's, forward only); then, through the loop's schedule, per micro-batch the policy's token
log-probs, the clipped per-token loss against the sampling policy's log-probs (its own, detached, on the step
that generated; with ``num_iterations`` mu > 1 the next mu - 1 steps train on the same completions against
those) and the (sum, count) of ``loss_type``. The loop divides the gradients by the global count.

Log-probs are those of the logits divided by ``grpo.temperature`` (TRL's): the stage's (and the reference's)
output head is wrapped so its loss divides them (``TemperedHead``); decoding reads the full logits, untouched,
and the sampler divides by the same temperature.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.config.loader import ConfigError
from mmtrain.convert.checkpoint_io import read_checkpoint_config
from mmtrain.core.manifest import ManifestError
from mmtrain.core.tokenizer_record import describe_record, tokenizer_mismatch
from mmtrain.data.grpo_prompts import PromptOrder
from mmtrain.inference.engine import DecodeEngine
from mmtrain.models.registry import model_family
from mmtrain.train.checkpoint import is_weights_only
from mmtrain.train.grpo_loss import aggregate, clip_counts, token_losses
from mmtrain.train.grpo_reward import RewardScorer, load_reward
from mmtrain.train.grpo_rollouts import Rollouts, generate_rollouts

# the step's stats (float64; summed over data-parallel ranks by the loop): [0] loss sum and [1] its count first
STATS = ("loss", "count", "reward", "reward_sq", "completions", "reward_errors", "rollout_errors", "kl",
         "completion_tokens", "clip_low", "clip_high", "zero_std_groups", "groups", "generation_s", "ranks",
         "trained_tokens", "generated_tokens", "prompt_tokens")
_I = {name: i for i, name in enumerate(STATS)}


class TemperedHead(nn.Module):
    """An output head whose loss sees the logits divided by ``temperature`` (so its per-token losses are the
    tempered distribution's -log p); the rest is the wrapped head's (full logits untouched: decoding)."""

    def __init__(self, head: nn.Module, temperature: float) -> None:
        super().__init__()
        self.inner, self.temperature = head, temperature

    @property
    def matmul(self):
        return self.inner.matmul

    def prepare(self, x):
        return self.inner.prepare(x)

    def logits(self, x, weight):
        return self.inner.logits(x, weight)

    def loss(self, logits, labels_BS):
        return self.inner.loss(logits.float() / self.temperature, labels_BS)

    def full_logits(self, logits):
        return self.inner.full_logits(logits)

    def compile_loss(self) -> None:
        self.inner.compile_loss()


def use_temperature(stage: nn.Module, temperature: float) -> None:
    """Make ``stage``'s token losses those of its logits / ``temperature`` (nothing at 1)."""
    if temperature != 1.0:
        stage.swap_head(lambda head, vocab_size: TemperedHead(head, temperature))


def reference_config(cfg, found):
    """The run config whose ``build_reference`` (DPO's) builds GRPO's reference: ``grpo.reference`` in the place
    of ``dpo.reference``. A resumed run needs it named (the reference must stay the initial model)."""
    if not cfg.grpo.reference and found is not None and not is_weights_only(found):
        raise ConfigError(f"resuming the GRPO run from {found} with grpo.beta > 0 needs grpo.reference: the "
                          "weights-only checkpoint it started from (the reference must stay the initial model)")
    return dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, reference=cfg.grpo.reference))


class GrpoStep:
    """The GRPO ``StepTask`` members of one rank: ``forward_backward``, ``step_flops``, ``extra_metrics``.
    ``schedule``: the loop's ``schedule_micro_batches``; ``flops_per_token``: the model's forward + backward."""

    def __init__(self, cfg, mesh, device: torch.device, stage: nn.Module, reference: nn.Module | None,
                 order: PromptOrder, schedule, flops_per_token: float) -> None:
        self.cfg, self.mesh, self.device, self.stage, self.reference = cfg, mesh, device, stage, reference
        self.order, self.schedule, self.flops_per_token = order, schedule, flops_per_token
        g = cfg.grpo
        self.epsilon_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        self.scorer = RewardScorer(load_reward(g.reward), g.reward, g.prompts)
        self.engine: DecodeEngine | None = None
        self.rollouts: Rollouts | None = None  # the last generation (reused by the next mu - 1 steps)

    # ------------------------------------------------------------------------------------------ rollouts
    def _share_rewards(self, values: torch.Tensor, failed: torch.Tensor) -> None:
        """The tensor-parallel group's first rank's rewards on every rank of it (in place)."""
        if self.mesh.dims.tp == 1:
            return
        both = torch.stack([values, failed]).to(self.device)
        dist.broadcast(both, src=self.mesh.ranks("tp")[0], group=self.mesh.tp_group)
        values.copy_(both[0].cpu())
        failed.copy_(both[1].cpu())

    def _check_same_tokens(self, rollouts: Rollouts) -> None:
        """The ranks of a tensor-parallel group must train on the same completions (they decode them alike)."""
        if self.mesh.dims.tp == 1:
            return
        sums = [(b.tokens * torch.arange(1, b.tokens.shape[1] + 1)).sum() for b in rollouts.batches]
        mine = torch.tensor([float(sum(sums)), -float(sum(sums))], dtype=torch.float64, device=self.device)
        seen = mine.clone()
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.mesh.tp_group)
        if not torch.equal(seen, mine):
            raise RuntimeError("GRPO: the ranks of a tensor-parallel group decoded different completions (their "
                               "logits differ); this is a bug, please report it with the layout")

    def _generate(self, rows: list[torch.Tensor]) -> Rollouts:
        g, mbs = self.cfg.grpo, rows[0].shape[0]
        if self.engine is None:  # one cache for the run: every completion of a step decodes at once
            # train.compile compiles the decode step too (CUDA graphs on a GPU): eager, a 1B shape's batch-128 step
            # is launch-bound (session 17 on the H200: 14 ms a token, 84% of a GRPO step in generation)
            self.engine = DecodeEngine(self.stage, len(rows) * mbs * g.group_size, self.cfg.data.seq_length,
                                       compile=self.cfg.train.compile, vocab_limit=self.order.tokenizer.max_id + 1)
        try:
            rollouts = generate_rollouts(self.engine, rows, self.order.prompts, self.order.tokenizer, g,
                                         self.cfg.train.seed, self.scorer, self._share_rewards)
        finally:
            self.stage.train()  # the engine put it in eval mode
        self._check_same_tokens(rollouts)
        if self.reference is not None:
            with torch.no_grad():
                self.schedule(lambda i, received, module=self.reference: self._reference_step(rollouts, i, module),
                              len(rows), self.reference, self.mesh, self.cfg, self.device, None, self._shape(rollouts))
        return rollouts

    def _reference_step(self, rollouts: Rollouts, i: int, module: nn.Module) -> torch.Tensor:
        b = rollouts.batches[i]
        tokens = b.tokens.to(self.device)
        out = module(tokens[:, :-1], tokens[:, 1:])
        b.ref_logp = -out.float().detach()
        return out

    def _shape(self, rollouts: Rollouts) -> tuple[int, int, int]:
        b = rollouts.batches[0]
        return b.tokens.shape[0], b.tokens.shape[1] - 1, self.cfg.model.shape().hidden_size

    # ------------------------------------------------------------------------------------------ the step
    def forward_backward(self, micro_batches: list[torch.Tensor], buckets) -> torch.Tensor:
        """Generate (or reuse, iterations 1..mu-1) the step's completions, then the policy's forward and backward
        per micro-batch; returns the stats ``STATS`` of this rank."""
        g = self.cfg.grpo
        key = tuple(int(n) for r in micro_batches for n in r[:, 1].tolist())
        fresh = int(micro_batches[0][0, 2]) == 0 or self.rollouts is None or self.rollouts.key != key
        if fresh:  # a resumed run in the middle of mu iterations generates again (pi_old: the current policy)
            self.rollouts = self._generate(micro_batches)
        rollouts = self.rollouts
        stats = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)

        def policy_step(i, received, module=self.stage):
            b = rollouts.batches[i]
            tokens, mask = b.tokens.to(self.device), b.mask.to(self.device)
            logp = -module(tokens[:, :-1], tokens[:, 1:]).float()
            if fresh and g.num_iterations > 1:
                b.old_logp = logp.detach()
            old = logp.detach() if fresh else b.old_logp
            adv = b.advantages.to(self.device)
            terms = token_losses(logp, old, adv, g.epsilon, self.epsilon_high, g.beta,
                                 None if b.ref_logp is None else b.ref_logp.to(self.device))
            total, count = aggregate(terms.loss, mask, g.loss_type, g.max_new_tokens)
            low, high = clip_counts(terms.ratio.detach(), adv, mask, g.epsilon, self.epsilon_high)
            stats[_I["loss"]] += total.detach().double()
            stats[_I["count"]] += count.double() if torch.is_tensor(count) else count
            stats[_I["completion_tokens"]] += mask.sum().double()
            stats[_I["clip_low"]] += low.double()
            stats[_I["clip_high"]] += high.double()
            if terms.kl is not None:
                stats[_I["kl"]] += (terms.kl.detach() * mask).sum().double()
            stats[_I["trained_tokens"]] += b.real_tokens
            return total

        self.schedule(policy_step, len(micro_batches), self.stage, self.mesh, self.cfg, self.device, buckets,
                      self._shape(rollouts))
        r = rollouts.rewards
        host = {"reward": float(r.sum()), "reward_sq": float((r * r).sum()), "completions": float(r.numel()),
                "reward_errors": float(rollouts.reward_errors), "rollout_errors": float(rollouts.rollout_errors),
                "zero_std_groups": float(rollouts.zero_std_groups), "groups": float(r.numel() // g.group_size),
                "ranks": 1.0}
        if fresh:
            host.update(generation_s=rollouts.generation_s, generated_tokens=float(rollouts.generated_tokens),
                        prompt_tokens=float(rollouts.prompt_tokens))
        for name, value in host.items():
            stats[_I[name]] += value
        return stats

    # ------------------------------------------------------------------------------------------ reporting
    def step_flops(self, stats: torch.Tensor) -> float:
        """Training (forward + backward) over the trained tokens, the reference's forward (beta > 0) and the
        decoding's forward over prompts and generated tokens (a forward is a third of forward + backward)."""
        if stats is None:
            return 0.0
        s = stats.tolist()
        train = s[_I["trained_tokens"]] * (1 + (1 / 3 if self.reference is not None else 0))
        decode = (s[_I["generated_tokens"]] + s[_I["prompt_tokens"]]) / 3
        return (train + decode) * self.flops_per_token

    def extra_metrics(self, stats: torch.Tensor, dt: float) -> dict:
        """The step's GRPO figures (TRL's names where it has them)."""
        s = dict(zip(STATS, stats.tolist()))
        n, tokens = max(s["completions"], 1.0), max(s["completion_tokens"], 1.0)
        variance = (s["reward_sq"] - s["reward"] ** 2 / n) / max(n - 1, 1.0)
        generation_s = s["generation_s"] / max(s["ranks"], 1.0)  # the mean over data-parallel ranks
        world = self.mesh.dims.world_size
        row = {"reward": s["reward"] / n, "reward_std": max(variance, 0.0) ** 0.5,
               "reward_errors": int(s["reward_errors"]), "rollout_errors": int(s["rollout_errors"]),
               "frac_reward_zero_std": s["zero_std_groups"] / max(s["groups"], 1.0),
               "completion_length": s["completion_tokens"] / n,
               "clip_ratio_low": s["clip_low"] / tokens, "clip_ratio_high": s["clip_high"] / tokens,
               "clip_ratio": (s["clip_low"] + s["clip_high"]) / tokens,
               "generation_s": generation_s, "train_s": max(dt - generation_s, 0.0),
               "rollouts_per_s": s["completions"] / dt if s["generation_s"] > 0 else 0.0,
               "tokens_per_s": s["trained_tokens"] / dt / world}
        if self.reference is not None:
            row["kl"] = s["kl"] / tokens
        return row


def check_start_tokenizer(found, tokenizer) -> None:
    """The checkpoint the run starts from (``found``, or None) must name the tokenizer of ``grpo.tokenizer``, when
    it names one (equal vocabulary sizes would hide another tokenizer: the ids fit, the rewards are noise)."""
    if found is None:
        return
    try:
        other = tokenizer_mismatch(read_checkpoint_config(found)[1], tokenizer.describe())
    except ManifestError as exc:
        raise ConfigError(f"checkpoint.load={found}: {exc}") from None
    if other is not None:
        raise ConfigError(f"grpo.tokenizer={tokenizer.path} is not the tokenizer of the model in {found} (its "
                          f"{other[1]} names the {describe_record(other[0])}); give that one as grpo.tokenizer")


def grpo_step(cfg, mesh, device, stage, reference, order: PromptOrder, schedule, found) -> GrpoStep:
    """The GRPO step of this rank (the loop makes its ``StepTask`` of it, as of DPO's), after checking the
    tokenizer against the checkpoint the run starts from (``found``); the stage's and the reference's heads
    tempered first."""
    check_start_tokenizer(found, order.tokenizer)
    use_temperature(stage, cfg.grpo.temperature)
    if reference is not None:
        use_temperature(reference, cfg.grpo.temperature)
    flops = model_family(cfg.model).flops_per_token(cfg.model, cfg.data.seq_length)
    return GrpoStep(cfg, mesh, device, stage, reference, order, schedule, flops)
