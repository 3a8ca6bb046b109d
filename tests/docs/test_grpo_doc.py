"""docs/grpo.md runs as written on the CPU, in a copy of the user guide's folder: sample prompts, the guide's model
as the start, a GRPO run whose mean reward rises, and greedy completions before and after. What the page says
happened is checked after it ran."""

from __future__ import annotations

import json

import numpy as np

from dataprep.samples import GRPO_OBJECTS
from tests.docs.doc_runner import REPO, copy_folder, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "grpo.md"


def test_only_the_gpu_command_is_skipped():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    skipped = [b.body for b in blocks if b.kind == "skip"]
    assert len(skipped) == 1 and "torchrun" in skipped[0] and "cuda" in skipped[0]
    run = "\n".join(b.body for b in blocks if b.kind == "run")
    for needle in ("write_sample_prompts", "hf-to-mmtrain", "--config grpo.yaml", "mmtrain.generate"):
        assert needle in run, needle


def test_grpo_runs_from_the_user_guides_outputs(guide_folder, tmp_path):
    work = copy_folder(guide_folder, tmp_path / "work")
    run_page(PAGE, work)
    rows = [json.loads(line) for line in (work / "runs/grpo/metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    assert len(rows) == 20 and np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.1, rewards
    assert all(r["reward_errors"] == 0 and r["kl"] >= 0 and r["generation_s"] > 0 for r in rows)
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0  # the policy starts as its reference
    complete = json.loads(next((work / "runs/grpo/checkpoints").glob("step_*/complete.json")).read_text())
    assert complete["tokenizer"]["path"].endswith("tok/sp.model")
    after = [json.loads(line)["completion"] for line in (work / "after.jsonl").read_text().splitlines()]
    assert len(after) == 2 and all(any(o in c for o in GRPO_OBJECTS) for c in after), after
