"""docs/adding-a-model-family.md, walked as written: its file blocks make a toy family in a copy of ``mmtrain/``,
its one table line goes into that copy's ``mmtrain/models/families.py``, and its commands (run with the copy
first on PYTHONPATH) regenerate the config reference, train through ``python -m mmtrain.pretrain_gpt`` on the
CPU and decode with the KV cache. A member the page says is required, taken away, gives the one line it quotes."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.docs.doc_runner import REPO, guide_env, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "adding-a-model-family.md"


def _copy_of_the_package(root):
    shutil.copytree(REPO / "mmtrain", root / "mmtrain", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "docs").mkdir()
    shutil.copy(REPO / "docs" / "config-reference.md", root / "docs")
    return root


def test_the_page_adds_a_family_in_its_folder_and_one_table_line():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    written = {b.file for b in blocks if b.kind == "file"}
    folder = {f for f in written if f.startswith("mmtrain/")}
    assert {f.rsplit("/", 1)[0] for f in folder} == {"mmtrain/models/toy"}
    assert {f.rsplit("/", 1)[1] for f in folder} == {"__init__.py", "config.py", "model.py", "family.py"}
    assert written - folder == {"configs/gpt/toy_cpu_mock.yaml"}
    (insert,) = [b for b in blocks if b.kind == "insert"]
    assert insert.file == "mmtrain/models/families.py" and len(insert.body.splitlines()) == 1
    assert not [b for b in blocks if b.kind == "skip"]


def test_the_toy_family_of_the_page_trains_and_decodes(tmp_path):
    root = _copy_of_the_package(tmp_path / "tree")
    outputs = run_page(PAGE, root, timeout=600, code=root)
    reference, trained, decoded = (outputs[line] for line in sorted(outputs))
    assert int(reference) > 0  # the toy's section is in the regenerated reference
    assert "decode equals forward" in decoded
    rows = [json.loads(r) for r in (root / "runs/toy_cpu/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and json.loads(trained.splitlines()[-1])["step"] == 4
    marker = json.loads(next((root / "runs/toy_cpu/checkpoints").rglob("complete.json")).read_text())
    assert '"toy"' in json.dumps(marker)  # the checkpoint records the family it was trained as

    # the page's one line when the stage lacks a member of the contract
    with (root / "mmtrain/models/toy/model.py").open("a") as f:
        f.write("\nToyModel.decode = None  # the test takes the member away\n")
    probe = ("from mmtrain.config import ModelConfig\nfrom mmtrain.models.registry import model_family\n"
             "model_family(ModelConfig(family='toy'))\n")
    proc = subprocess.run(["python", "-c", probe], cwd=root, env=guide_env(root), capture_output=True, text=True,
                          timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("mmtrain.models.families.FamilyContractError: ")
    message = last.split(": ", 1)[1]
    assert message.startswith("model family 'toy': ToyModel lacks decode ")
    assert f"`FamilyContractError: {message}`" in " ".join(PAGE.read_text(encoding="utf-8").split())
