"""docs/user-guide.md is executable: its shell blocks run in order in an empty folder on the CPU, with the files
its marked blocks give, so the guide cannot drift from the code."""

from __future__ import annotations

import json

from mmtrain.core.tokenizer import load_tokenizer
from tests.docs.doc_runner import GUIDE, guide_env  # noqa: F401 - test_readme_gpt_run.py imports guide_env from here
from tests.docs.guide_blocks import page_blocks


def test_guide_markers_are_few_and_known():
    blocks = page_blocks(GUIDE.read_text(encoding="utf-8"))
    kinds = [b.kind for b in blocks]
    assert kinds.count("skip") <= 2, [b.line for b in blocks if b.kind == "skip"]  # keep what is not run small
    assert kinds.count("run") >= 8 and {b.file for b in blocks if b.kind == "file"} >= {"blend.yaml", "run.yaml"}


def test_user_guide_runs_from_an_empty_folder(guide_folder):
    work = guide_folder  # the session's run of every block of the guide (tests/docs/conftest.py)
    # what the guide says happened did happen
    rows = [json.loads(line) for line in (work / "runs/guide/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))  # stopped at 40 (step 6), resumed to 60 (step 8)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert (work / "hf-tiny" / "config.json").is_file()
    # step 2's chat tokenizer: chatml's tokens are single tokens, the template is next to the model
    tok = load_tokenizer(work / "tok/sp.model")
    assert tok.encode("<|im_start|>user<|im_end|>")[-1] == tok.token_id("<|im_end|>") is not None
    assert "<|im_start|>" in json.loads((work / "tok/tokenizer_config.json").read_text())["chat_template"]
    assert (work / "hf-tiny" / "tokenizer.json").is_file()  # the checkpoint names its data's tokenizer
    vlm = [json.loads(line) for line in (work / "runs/vlm/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in vlm] == list(range(1, 11))
