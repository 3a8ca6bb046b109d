"""GRPO's rollouts: each prompt of a step completed ``grpo.group_size`` times by the policy being trained, through
the KV-cache decode engine on the training stage itself (``mmtrain.inference.engine``: the same modules and
weights, TP-sharded as they train; nothing is copied), then scored, normalized per group and cut into the
step's micro-batches.

Completion ``k`` of the prompt at generation index ``n`` draws from its own generator seeded by (``train.seed``,
n, k), so the tokens do not depend on the layout: data-parallel ranks complete different prompts, the ranks of
a tensor-parallel group the same ones with the same draws (their logits are the gathered vocabulary shards, the
same on every rank; the step checks that the tokens agree). A completion that ends at the end-of-document
token keeps that token (it is trained on, as TRL does), one that ends at ``grpo.max_new_tokens`` does not have
it. A completion whose decoding failed (a non-finite logit: ``finish_reason`` "error") carries no loss and is
counted (``rollout_errors``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mmtrain.data.grpo_prompts import Prompt
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.sampling import SamplingParams
from mmtrain.train.grpo_loss import group_advantages
from mmtrain.train.grpo_reward import RewardScorer


@dataclass
class RolloutBatch:
    """One micro-batch of completions: ``tokens`` (B, L) prompt + completion, right-padded with 0; ``mask`` (B,
    L - 1) 1 where the label (the next token) is a completion token; ``advantages`` (B,); the reference's and the
    sampling policy's token log-probs (B, L - 1), once computed."""

    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    real_tokens: int  # prompt and completion tokens, not the padding
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None


@dataclass
class Rollouts:
    """A step's completions as micro-batches, with what the metrics report of them."""

    batches: list[RolloutBatch]
    rewards: torch.Tensor  # (N,) float64, every completion of this rank
    reward_errors: int
    rollout_errors: int
    zero_std_groups: int
    generated_tokens: int
    prompt_tokens: int
    generation_s: float
    key: tuple[int, ...] = field(default=())  # the generation indices of its prompts


def rollout_seed(seed: int, generation: int, k: int) -> int:
    """The sampling seed of completion ``k`` of the prompt at generation index ``generation``."""
    return int(np.random.SeedSequence([seed, generation, k]).generate_state(1, np.uint64)[0] >> 1)


def sampling_params(g, seed: int, eod: int | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                          seed=seed, stop_token_ids=() if eod is None else (eod,))


def generate_rollouts(engine: DecodeEngine, rows: list[torch.Tensor], prompts: list[Prompt], tokenizer, g,
                      seed: int, scorer: RewardScorer, share_rewards) -> Rollouts:
    """Complete, score and batch the prompts of ``rows`` (each micro-batch's (mbs, 3) rows of ``PromptOrder``).
    ``g``: the grpo section; ``share_rewards(values, failed)``: makes the rewards the same on every rank of the
    tensor-parallel group (scored on its first rank: a reward function need not be deterministic)."""
    G, eod = g.group_size, tokenizer.eod_id
    asked = [(int(p), int(n)) for r in rows for p, n, _ in r.tolist()]
    if engine.device.type == "cuda":  # the previous step's training is not generation time (the first read-back
        torch.cuda.synchronize(engine.device)  # of the decode waits for it anyway: this wait costs nothing)
    t0 = time.perf_counter()
    seqs = generate(engine, [prompts[p].ids for p, _ in asked for _ in range(G)],
                    [sampling_params(g, rollout_seed(seed, n, k), eod) for _, n in asked for k in range(G)],
                    decode=tokenizer.decode)
    generation_s = time.perf_counter() - t0
    completions, failed_decode = [], []
    for s in seqs:
        failed_decode.append(s.finish_reason == "error")
        ended = s.finish_reason == "stop" and eod is not None
        completions.append(list(s.token_ids) + ([eod] if ended else []))
    values = torch.zeros(len(seqs), dtype=torch.float64)
    failed = torch.zeros(len(seqs), dtype=torch.float64)
    for i, s in enumerate(seqs):
        if failed_decode[i]:
            continue
        prompt = prompts[asked[i // G][0]]
        values[i], bad = scorer.score(prompt.text, s.text, prompt.fields, prompt.line)
        failed[i] = float(bad)
    share_rewards(values, failed)
    advantages, zero_std = group_advantages(values, G, g.scale_rewards)
    per_micro = len(rows[0]) * G
    batches = []
    for m in range(len(rows)):
        span = range(m * per_micro, (m + 1) * per_micro)
        batches.append(_batch([prompts[asked[i // G][0]].ids for i in span], [completions[i] for i in span],
                              [failed_decode[i] for i in span], advantages[m * per_micro:(m + 1) * per_micro]))
    return Rollouts(batches, values, int(failed.sum()), sum(failed_decode), int(zero_std.sum()),
                    sum(len(s.token_ids) for s in seqs), G * sum(len(prompts[p].ids) for p, _ in asked),
                    generation_s, tuple(n for _, n in asked))


def _batch(prompt_ids: list, completions: list[list[int]], failed: list[bool],
           advantages: torch.Tensor) -> RolloutBatch:
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completions)]
    L = max(*lengths, 2)  # at least one label, even when every completion failed before its first token
    tokens = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L - 1, dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompt_ids, completions)):
        tokens[b, :len(p) + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        if not failed[b]:
            mask[b, len(p) - 1:len(p) - 1 + len(c)] = 1.0  # label j is token j + 1
    return RolloutBatch(tokens, mask, advantages.float(), sum(lengths))
