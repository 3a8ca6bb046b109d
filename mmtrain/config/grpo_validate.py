"""The checks of a ``train.objective: grpo`` run that need no file opened beyond an existence check (the prompts
are read, and checked line by line, when the run builds them: ``mmtrain.data.grpo_prompts``)."""

from __future__ import annotations

import re
from pathlib import Path

from mmtrain.config.family_sections import families_with
from mmtrain.config.loader import ConfigError

_REWARD_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def check_grpo_run(cfg, model_key: str = "model") -> None:
    """Raise ``ConfigError`` naming the key for a GRPO run this trainer cannot do (``cfg``: a GPT run)."""
    g, d, p, t = cfg.grpo, cfg.data, cfg.parallel, cfg.train
    if model_key != "model":
        raise ConfigError("train.objective=grpo trains a language model (python -m mmtrain.pretrain_gpt); a VLM run "
                          "trains with train.objective=lm")
    for key in ("prompts", "tokenizer"):
        value = getattr(g, key)
        if not value:
            raise ConfigError(f"train.objective=grpo needs grpo.{key} (docs/grpo.md)")
        if not Path(value).exists():
            raise ConfigError(f"grpo.{key}={value}: no such file or folder (looked for {Path(value).resolve()})")
    if not _REWARD_SPEC.fullmatch(g.reward):
        raise ConfigError(f"grpo.reward={g.reward!r}: name the reward function as package.module:function "
                          "(e.g. mmtrain.rewards:arithmetic_exact_match)")
    unused = [k for k, v in (("data.prefixes", d.prefixes), ("data.blend", d.blend), ("data.mock", d.mock),
                             ("data.reset_position_ids", d.reset_position_ids),
                             ("data.reset_attention_mask", d.reset_attention_mask),
                             ("data.eod_mask_loss", d.eod_mask_loss)) if v]
    if unused or d.type != "gpt":
        what = unused[0] if unused else f"data.type={d.type}"
        raise ConfigError(f"{what} is not read by train.objective=grpo: its prompts are grpo.prompts and its "
                          "samples the model's own completions; remove it")
    if g.max_new_tokens >= d.seq_length:
        raise ConfigError(f"grpo.max_new_tokens ({g.max_new_tokens}) must be below data.seq_length "
                          f"({d.seq_length}): a prompt and its completion are one sequence of at most "
                          "data.seq_length tokens")
    if g.reference and g.beta == 0:
        raise ConfigError("grpo.reference is read only with grpo.beta > 0 (the KL term); set grpo.beta or remove "
                          "grpo.reference")
    if t.eval_every:
        raise ConfigError("train.eval_every is not supported with train.objective=grpo (there is no held-out "
                          "loss); set train.eval_every=0 and watch the reward in the metrics")
    if not cfg.model.shape().supports_train_sampling:
        raise ConfigError(f"train.objective=grpo generates with the KV-cache decoder: {model_key}.family must be "
                          f"{' or '.join(families_with('supports_train_sampling'))} (got {cfg.model.family})")
    layout = [k for k, bad in (("parallel.pp > 1", p.pp > 1), ("parallel.cp > 1", p.cp > 1),
                               ("parallel.ep > 1", p.ep > 1), ("parallel.sequence_parallel", p.sequence_parallel),
                               ("parallel.fsdp", p.fsdp), ("train.precision=fp8", t.precision == "fp8")) if bad]
    if layout:
        raise ConfigError(f"train.objective=grpo does not support {layout[0]} yet: the rollouts decode the whole "
                          "model on each rank's tensor-parallel group; use parallel.tp and data parallelism "
                          "(bf16 or fp32)")
