"""Range checks of every numeric config field, from the bounds declared next to the field.

A field declares its range in ``doc(..., ge=1)`` (``ge``/``gt``: lower bound inclusive/exclusive, ``le``/``lt``:
upper bound); every float must also be finite. Lists are checked element by element (``parallel.pipeline_layers[2]``),
mappings value by value (``lr_scale.vision``). The checks run in ``validate_*_config``, before any process group,
so ``optim.lr=-1`` or ``optim.lr=nan`` is an error naming the key instead of a failure deep inside torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mmtrain.config.loader import ConfigError

_BOUNDS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
           ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b))


def range_text(metadata) -> str:
    """The declared range of a field, e.g. ``>= 0, < 1`` (empty when none is declared)."""
    return ", ".join(f"{sign} {_number(metadata[key])}" for key, sign, _ in _BOUNDS if key in metadata)


def _number(bound: Any) -> str:
    if isinstance(bound, int) and bound > 2**31 and (bound + 1) & bound == 0:  # 2**32 - 1 reads better as such
        return f"2^{bound.bit_length()}-1"
    return str(bound)


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Raise ``ConfigError`` for the first numeric value of ``cfg`` (a config dataclass, walked recursively)
    outside its declared range or not finite, naming its dotted key."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_ranges(value, key + ".")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _check_value(f"{key}[{i}]", item, f.metadata)
        elif isinstance(value, dict):
            for name, item in value.items():
                _check_value(f"{key}.{name}", item, f.metadata)
        else:
            _check_value(key, value, f.metadata)


def _check_value(key: str, value: Any, metadata) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        allowed = range_text(metadata)
        raise ConfigError(f"{key} must be a finite number{f' ({allowed})' if allowed else ''}, got {value}")
    for name, sign, ok in _BOUNDS:
        if name in metadata and not ok(value, metadata[name]):
            raise ConfigError(f"{key} must be {sign} {_number(metadata[name])}, got {value}")
