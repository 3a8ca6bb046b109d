"""``doc``: how every config dataclass declares a field (default, help text, numeric range).

Its own module so that the family shapes the run schema embeds (``mmtrain.models.<family>.config``) can use it without
importing the schema they are part of."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def doc(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a default and its help text (mutable defaults are copied per instance).

    Numeric fields declare their range here: ``ge``/``gt`` (lower bound, inclusive/exclusive) and ``le``/``lt``
    (upper bound); ``mmtrain.config.ranges`` checks every field (each element of a list, each value of a
    mapping) against them, and refuses NaN and infinities in any float field."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})
