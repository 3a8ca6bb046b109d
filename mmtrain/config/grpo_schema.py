"""The ``grpo`` section of a GPT run (``train.objective: grpo``; docs/grpo.md): where the prompts come from, how
each group of completions is sampled and scored, and the clipped policy objective (TRL's ``GRPOTrainer`` terms).

Torch-free, like the rest of the config layer; the run schema composes it as ``GPTRunConfig.grpo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmtrain.config.fields import doc

GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # TRL 1.16's names; dapo is its default


@dataclass
class GrpoConfig:
    """Group relative policy optimization (train.objective: grpo): the policy's own weights complete every prompt
    group_size times through the KV-cache decoder, a Python reward function scores each completion, and the
    clipped objective of TRL's GRPOTrainer (optionally with a KL penalty to a frozen reference) trains on the
    group-normalized advantages. train.micro_batch_size and train.global_batch_size count prompts."""

    prompts: str = doc("", "JSONL file of prompts: one object per line with a \"prompt\" string (the text the "
                           "model completes, encoded as is); its other fields are passed to the reward function as "
                           "keyword arguments (e.g. \"answer\").")
    tokenizer: str = doc("", "The model's tokenizer (SentencePiece .model, tokenizer.json or its folder, GPT-2 "
                             "vocab.json next to merges.txt): encodes the prompts, decodes the completions; its "
                             "end-of-document token ends a completion.")
    reward: str = doc("", "The reward function as \"package.module:function\", called once per completion as "
                          "function(prompt=..., completion=..., **fields) and returning a number. A call that "
                          "raises or returns anything but a finite number gives that completion reward 0 and is "
                          "counted (reward_errors). Examples: mmtrain.rewards:arithmetic_exact_match, "
                          "mmtrain.rewards:regex_format.")
    group_size: int = doc(8, "Completions per prompt (G); advantages are normalized within each group.", ge=2)
    temperature: float = doc(1.0, "Sampling temperature; the log-probabilities trained on are those of the logits "
                                  "divided by it, as TRL computes them.", gt=0)
    top_p: float = doc(1.0, "Nucleus sampling: the smallest set of most likely tokens whose mass reaches top_p.",
                       gt=0, le=1)
    top_k: int = doc(0, "Sample from the k most likely tokens only; 0 keeps every token.", ge=0)
    max_new_tokens: int = doc(64, "New tokens per completion at most; prompt tokens + max_new_tokens must fit "
                                  "data.seq_length.", ge=1)
    beta: float = doc(0.0, "KL coefficient (k3 estimator, per token, to a frozen reference model); 0 builds no "
                           "reference model.", ge=0)
    reference: str = doc("", "beta > 0: weights-only checkpoint of the frozen reference; empty: the run's initial "
                             "weights (the weights-only checkpoint.load, else the seeded init).")
    epsilon: float = doc(0.2, "Clipping: the ratio pi/pi_old is clipped to [1 - epsilon, 1 + epsilon_high].",
                         gt=0, lt=1)
    epsilon_high: float | None = doc(None, "Upper clipping bound (DAPO's clip-higher); null: epsilon.", gt=0)
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = doc(
        "dapo", "How token losses are averaged (TRL's loss_type): dapo (TRL's default) over every completion token "
                "of the global batch; grpo per completion, then over completions; dr_grpo over completions x "
                "max_new_tokens; bnpo over each micro-batch's tokens, then over micro-batches.")
    scale_rewards: Literal["group", "none"] = doc(
        "group", "Advantages are reward - group mean, divided by the group's standard deviation (+1e-4) with "
                 "group, left unscaled with none (Dr. GRPO).")
    num_iterations: int = doc(1, "Optimizer steps on each batch of completions (mu): the first generates them, "
                                 "the next ones reuse them with their log-probs at generation as pi_old.", ge=1)
