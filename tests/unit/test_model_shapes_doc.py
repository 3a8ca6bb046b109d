"""docs/user-guide.md's table of the model shapes that come with mmtrain stays true: every file of configs/models/
is listed, in the row of the family it sets (model.family), and the table names no other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmtrain.config import GPTRunConfig, load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_user_guide_lists_every_bundled_model_shape_under_its_family():
    guide = (REPO / "docs" / "user-guide.md").read_text(encoding="utf-8")
    table = guide.split("The model shapes that come with mmtrain", 1)[1].split("\n\n", 2)[1]
    listed = {}
    for row in table.splitlines()[2:]:
        family_cell, shapes_cell = row.strip("|").split("|")[:2]
        family = re.search(r"\(`(\w+)`", family_cell).group(1)
        for shape in re.findall(r"`([\w.-]+)`", shapes_cell.split(";")[0]):
            listed[shape] = family
    files = {p.stem: load_config(GPTRunConfig, p, ["data.mock=true"]).model.family
             for p in sorted((REPO / "configs" / "models").glob("*.yaml"))}
    assert listed == files
