"""A tiny GRPO run for the tests: a byte-level tokenizer, a prompts file, the run's overrides, and reward functions
they name (importable as ``tests.grpo_helpers:NAME`` from the spawned ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from tests.inference_helpers import tiny_tokenizer


def letter_fraction(prompt: str, completion: str, letter: str, **fields) -> float:
    """The toy task: the fraction of the completion's characters that are ``letter`` (a tiny model learns to
    favour the tokens holding it within a few dozen steps)."""
    return completion.count(letter) / max(len(completion), 1)


def misbehaving(prompt: str, completion: str, kind: str, **fields):
    """Fails in the way ``kind`` says (a prompt field), else 1.0."""
    if kind == "raise":
        raise ValueError("no verdict")
    return {"str": "1.0", "nan": math.nan, "none": None}.get(kind, 1.0)


def write_prompts(folder: Path, rows: list[dict]) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def grpo_overrides(folder: Path, *extra: str, prompts: list[dict] | None = None,
                   reward: str = "tests.grpo_helpers:letter_fraction") -> list[str]:
    """A tiny fp32 CPU GRPO run in ``folder`` (tokenizer and prompts written there): 4 prompts a step, groups of
    8, up to 8 new tokens; ``extra`` overrides last."""
    tok = folder / "tok" / "tokenizer.json"
    if not tok.is_file():
        tiny_tokenizer(folder / "tok", chat_template=False)
    rows = prompts or [{"prompt": f"Question {i}: write e", "letter": "e"} for i in range(16)]
    path = write_prompts(folder, rows)
    return ["train.objective=grpo", f"grpo.prompts={path}", f"grpo.tokenizer={tok}", f"grpo.reward={reward}",
            "grpo.group_size=8", "grpo.max_new_tokens=8", "data.seq_length=32", "model.vocab_size=512",
            "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", "train.precision=fp32", "train.device=cpu", "train.micro_batch_size=4",
            "optim.lr=1e-2", "optim.warmup_steps=0", "checkpoint.save_final=false", "logging.log_every=1",
            f"logging.run_dir={folder / 'run'}", *extra]


def train_rank(rank: int, world_size: int, overrides: list[str]):
    """One rank of a GRPO run (for ``mmtrain.testing.run_distributed``): its losses and grad norms."""
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    return result.losses, result.grad_norms


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
