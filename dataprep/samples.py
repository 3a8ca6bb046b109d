"""A small, deterministic sample corpus generated on the spot (no download): the quick-start demo's data.

Sentences come from a little grammar, so a tiny model can learn real structure in a few dozen steps and
its loss visibly falls. Same ``seed`` -> byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mmtrain.utils.atomic import atomic_open

_SUBJECTS = ["the cat", "a small dog", "the old sailor", "my neighbour", "the teacher", "a young fox",
             "the baker", "our team", "the river", "a curious child", "the robot", "the gardener"]
_VERBS = ["watches", "finds", "carries", "paints", "follows", "builds", "remembers", "visits", "cleans", "hears"]
_OBJECTS = ["the red ball", "a quiet garden", "the long road", "an empty boat", "the bright moon", "a warm loaf",
            "the tall tower", "a blue kite", "the green hill", "a sleeping owl", "the wooden bridge"]
_PLACES = ["in the morning", "after the rain", "near the harbour", "under the stars", "before dinner",
           "on a Sunday", "at the market", "beside the lake"]
_ENDINGS = [".", ".", ".", "!", "?"]


def _sentence(rng: random.Random) -> str:
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        words += f" {rng.choice(_PLACES)}"
    return words[0].upper() + words[1:] + rng.choice(_ENDINGS)


def sample_documents(num_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        text = " ".join(_sentence(rng) for _ in range(rng.randint(2, 12)))
        if i % 97 == 0:
            text += " Café, naïve, 東京, and 🙂 appear too."  # a little Unicode, as real data has
        docs.append(text)
    return docs


def write_sample_jsonl(path: str | Path, num_docs: int = 2000, seed: int = 0) -> Path:
    """Write ``{"id", "text"}`` rows to ``path`` atomically and return it."""
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(sample_documents(num_docs, seed)):
            f.write(json.dumps({"id": f"doc-{i:06d}", "text": text}, ensure_ascii=False) + "\n")
    return path
