"""docs/evaluate.md runs as written on the CPU, in a copy of the user guide's folder: loss and perplexity of the
guide's checkpoint, and a local lm-eval task scored by the mmtrain model and by lm-eval's hf model on the export."""

from __future__ import annotations

import json

import pytest

from tests.docs.doc_runner import REPO, copy_folder, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "evaluate.md"


def test_only_installs_downloads_and_multi_gpu_commands_are_skipped():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    skipped = [b.body for b in blocks if b.kind == "skip"]
    assert len(skipped) == 3 and any("pip install" in b for b in skipped) and any("torchrun" in b for b in skipped)
    assert any("hellaswag" in b for b in skipped)
    run = "\n".join(b.body for b in blocks if b.kind == "run")
    for needle in ("mmtrain.evaluate", "mmtrain.lm_eval --model mmtrain", "mmtrain-to-hf", "lm_eval --model hf"):
        assert needle in run, needle


def _acc(folder) -> float:
    (path,) = folder.rglob("results_*.json")
    return json.loads(path.read_text())["results"]["guide_mc"]["acc,none"]


def test_evaluate_runs_from_the_user_guides_outputs(guide_folder, tmp_path):
    pytest.importorskip("lm_eval")  # the page installs mmtrain[eval]
    work = copy_folder(guide_folder, tmp_path / "work")
    outputs = run_page(PAGE, work)
    table = next(out for out in outputs.values() if out.startswith("split"))
    split, samples, tokens, loss, perplexity = table.splitlines()[1].split()
    assert split == "valid" and int(samples) > 0 and float(perplexity) == pytest.approx(2.718281828 ** float(loss),
                                                                                         rel=1e-3)
    result = json.loads((work / "eval.json").read_text())
    assert result["split"] == "test" and result["loss"] > 0
    assert _acc(work / "results") == _acc(work / "results-hf") > 1 / 3  # the same numbers; better than chance
