"""docs/distillation.md runs as written on the CPU, in a copy of the user guide's folder: a small student trained on
the guide's data alone and distilled from the guide's model trained longer, then the three scored by mmtrain.evaluate; what the
page says happened is checked after it ran."""

from __future__ import annotations

import json

from tests.docs.doc_runner import REPO, copy_folder, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "distillation.md"


def test_the_cpu_path_is_run_and_only_the_gpu_command_is_skipped():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    run = "\n".join(b.body for b in blocks if b.kind == "run")
    for needle in ("--config student.yaml", "train.objective=distill", "distill.teacher=runs/teacher/checkpoints",
                   "mmtrain.evaluate"):
        assert needle in run, needle
    (skipped,) = [b for b in blocks if b.kind == "skip"]
    assert "train.device=cuda" in skipped.body and "train.objective=distill" in skipped.body


def test_distillation_runs_from_the_user_guides_outputs(guide_folder, tmp_path):
    work = copy_folder(guide_folder, tmp_path / "work")
    run_page(PAGE, work)
    rows = [json.loads(line) for line in (work / "runs/distilled/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41)) and {"ce", "kl"} <= set(rows[0])
    assert rows[-1]["kl"] < rows[0]["kl"]  # the student moves towards the teacher
    loss = {name: json.loads((work / f"{name}.json").read_text())["loss"] for name in ("teacher", "student",
                                                                                        "distilled")}
    assert loss["teacher"] < loss["distilled"] < loss["student"], loss
