"""A small, deterministic sample corpus generated on the spot (no download): the quick-start demo's data, and
chat conversations and preference pairs over the same grammar for the post-training walk-through
(docs/post-training.md), and GRPO prompts with the fields of the example rewards (docs/grpo.md).

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


def _answer(rng: random.Random, subject: str) -> str:
    words = f"{subject} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return words[0].upper() + words[1:] + "."


def sample_chats(num: int, seed: int = 0) -> list[dict]:
    """OpenAI-style ``{"messages": [...]}`` records: what does SUBJECT do? -> a sentence about SUBJECT (some
    with a system message, some with a second turn)."""
    rng = random.Random(seed)
    records = []
    for _ in range(num):
        messages = [{"role": "system", "content": "Answer in one sentence."}] if rng.random() < 0.3 else []
        for _ in range(2 if rng.random() < 0.25 else 1):
            subject = rng.choice(_SUBJECTS)
            messages += [{"role": "user", "content": f"What does {subject} do?"},
                         {"role": "assistant", "content": _answer(rng, subject)}]
        records.append({"messages": messages})
    return records


def sample_preferences(num: int, seed: int = 0) -> list[dict]:
    """``{"prompt", "chosen", "rejected"}`` records: the chosen answer is a sentence about the subject asked for,
    the rejected one the same words in a shuffled order."""
    rng = random.Random(seed)
    records = []
    for _ in range(num):
        subject = rng.choice(_SUBJECTS)
        chosen = _answer(rng, subject)
        words = chosen.rstrip(".").lower().split()
        while " ".join(words) == chosen.rstrip(".").lower():
            rng.shuffle(words)
        records.append({"prompt": f"What does {subject} do?", "chosen": chosen,
                        "rejected": " ".join(words).capitalize() + "."})
    return records


# the objects GRPO's sample task rewards (a regular expression over the completion: mmtrain.rewards:regex_format)
GRPO_OBJECTS = ("the red ball", "a blue kite", "an empty boat")


def sample_prompts(num: int, seed: int = 0) -> list[dict]:
    """``{"prompt", "pattern"}`` records for ``mmtrain.rewards:regex_format``: a sentence's subject and verb, to be
    completed with one of ``GRPO_OBJECTS`` (the grammar has 11 objects, so a model of the corpus names one of
    these about a quarter of the time before training)."""
    rng = random.Random(seed)
    pattern = "(" + "|".join(GRPO_OBJECTS) + r")\b.*"
    return [{"prompt": f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)}".capitalize(), "pattern": pattern}
            for _ in range(num)]


def sample_arithmetic(num: int, seed: int = 0) -> list[dict]:
    """``{"prompt", "answer"}`` records for ``mmtrain.rewards:arithmetic_exact_match``: ``"Q: 12 + 7 = ?\nA:"``
    with sums and differences of numbers below 100."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randrange(100), rng.randrange(100)
        op = rng.choice("+-")
        rows.append({"prompt": f"Q: {a} {op} {b} = ?\nA:", "answer": str(a + b if op == "+" else a - b)})
    return rows


def write_sample_prompts(path: str | Path, num: int = 200, seed: int = 0, task: str = "regex") -> Path:
    """Write :func:`sample_prompts` (``task`` "regex") or :func:`sample_arithmetic` ("arithmetic") as JSONL to
    ``path`` atomically and return it."""
    rows = {"regex": sample_prompts, "arithmetic": sample_arithmetic}[task](num, seed)
    return _write_rows(path, rows)


def write_sample_chats(path: str | Path, num: int = 400, seed: int = 0) -> Path:
    """Write :func:`sample_chats` as JSONL to ``path`` atomically and return it."""
    return _write_rows(path, sample_chats(num, seed))


def write_sample_preferences(path: str | Path, num: int = 200, seed: int = 0) -> Path:
    """Write :func:`sample_preferences` as JSONL to ``path`` atomically and return it."""
    return _write_rows(path, sample_preferences(num, seed))


def _write_rows(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return path
