"""Train/valid/test document ranges from a split string like ``969,30,1`` (Megatron's rounding)."""

from __future__ import annotations

import math

import numpy as np

SPLITS = ("train", "valid", "test")


class SplitError(ValueError):
    """A bad ``data.split`` string."""


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized train/valid/test fractions (missing trailing parts are 0)."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise SplitError(f"data.split={split!r}: expected up to three comma-separated numbers like 969,30,1") from None
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise SplitError(f"data.split={split!r}: expected 1 to 3 non-negative numbers with a positive sum, "
                         "e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = float(np.sum(np.array(values, dtype=np.float64)))
    return [v / total for v in values]


def split_document_ranges(split: str, num_documents: int) -> dict[str, tuple[int, int]]:
    """Document range ``[begin, end)`` of each split, with Megatron's rounding of the cumulative fractions."""
    fractions = parse_split(split)
    bounds = [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    return {name: (int(round(bounds[i] * num_documents)), int(round(bounds[i + 1] * num_documents)))
            for i, name in enumerate(SPLITS)}
