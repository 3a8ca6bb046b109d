"""Verifiable rewards for GRPO (``grpo.reward``; docs/grpo.md): examples of the interface, usable as they are.

A reward function is called once per completion with keyword arguments: ``prompt`` (the prompt's text),
``completion`` (the completion's text, without the end-of-document token) and every other field of the prompt's
line in the prompts file; it returns a number. Accept ``**fields`` to ignore the fields you do not read.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def arithmetic_exact_match(prompt: str, completion: str, answer: str | int | float, **fields) -> float:
    """1.0 when the first number of the completion equals ``answer`` (a prompt line's field, e.g.
    ``{"prompt": "12 + 7 =", "answer": "19"}``), else 0.0."""
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    return 1.0 if float(found.group()) == float(answer) else 0.0


def regex_format(prompt: str, completion: str, pattern: str, **fields) -> float:
    """1.0 when the whole completion (surrounding whitespace aside) matches the regular expression ``pattern`` (a
    prompt line's field, e.g. ``"<answer>\\\\d+</answer>"``; ``.`` also matches newlines), else 0.0."""
    return 1.0 if re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) else 0.0
