"""A Hugging Face ``config.json`` checked against the weights it comes with, before anything is converted.

An adapter lists the tensors its config implies (``Shapes``: HF name -> one ``Size`` per dimension, each naming
the config key it comes from) and ``check_shapes`` compares them with the shapes the safetensors headers give
(``LazyTensor``s or real tensors: only ``.shape`` is read), so a config that contradicts its weights (vocabulary
10^12, 4 KV heads where the weights hold 2) is one line naming the key, the config's value and the weights'
before any tensor is built from it. Counted parts (layers, experts) are compared first (``check_count``), so a
config claiming 10^7 layers is refused before 10^7 layers' names are listed. ``config_int`` refuses a config
integer that is missing its type or sign. The adapter passes its own error class; names of tensors the weights
lack are left to its mapping, which names them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class Size:
    """One dimension the config implies: ``value`` of config key ``key`` times ``unit`` (``unit_name`` says what
    the unit is, e.g. ``head_dim 16``); ``key`` empty for a constant."""

    key: str
    value: int
    unit: int = 1
    unit_name: str = ""

    @property
    def size(self) -> int:
        return self.value * self.unit


Shapes = dict[str, tuple[Size, ...]]


def fixed(n: int) -> Size:
    """A dimension no config key sets (the 3 colour channels of a patch convolution)."""
    return Size("", n)


def config_int(hf: Mapping[str, Any], key: str, error: type[Exception], minimum: int = 1, default: Any = _MISSING,
               prefix: str = "") -> Any:
    """``hf[key]`` (``default`` when absent, if given; a missing key without one is a ``KeyError``), refused
    with ``error`` unless it is an integer >= ``minimum`` (``default`` itself passes unchecked)."""
    if key not in hf and default is not _MISSING:
        return default
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"config.json: {prefix}{key}={value!r} must be an integer >= {minimum}")
    return value


def indices(names: Iterable[str], pattern: str) -> set[int]:
    """The integers ``pattern`` (a regular expression with one group) captures at the start of ``names``."""
    compiled = re.compile(pattern)
    return {int(m.group(1)) for n in names if (m := compiled.match(n))}


def check_count(key: str, value: int, found: set[int], what: str, error: type[Exception], prefix: str = "",
                at_most: bool = False) -> None:
    """The weights hold ``what`` numbered ``found`` (``indices``): the config's ``key`` must be their count
    (``at_most``: not more than it, the weights may hold more, which the mapping then names)."""
    held = max(found) + 1 if found else 0
    if value > held or (value != held and not at_most):
        raise error(f"config.json: {prefix}{key}={value}, but the weights hold {held} {what}; config.json and the "
                    "weights disagree")


def _describe(d: Size, prefix: str) -> str:
    if not d.key:
        return str(d.size)
    if d.unit == 1:
        return f"{prefix}{d.key}={d.value}"
    return f"{prefix}{d.key}={d.value} (x {d.unit_name} = {d.size})"


def _held(d: Size, n: int) -> str:
    if d.unit == 1:
        return str(n)
    return str(n // d.unit) if n % d.unit == 0 else f"a size of {n}, not a multiple of {d.unit_name}"


def check_shapes(expected: Shapes, tensors: Mapping[str, Any], error: type[Exception], prefix: str = "") -> None:
    """Raise ``error`` at the first tensor of ``tensors`` whose shape differs from ``expected`` (names absent
    from ``tensors`` are skipped), naming the config key, its value and the size the weights hold."""
    for name, dims in expected.items():
        if name not in tensors:
            continue
        shape = tuple(tensors[name].shape)
        if len(shape) != len(dims):
            raise error(f"config.json: {name} has shape {shape}, the config implies "
                        f"{tuple(d.size for d in dims)}; config.json and the weights disagree")
        for axis, (d, n) in enumerate(zip(dims, shape)):
            if n == d.size:
                continue
            held = "" if not d.key else f", but the weights hold {_held(d, n)}"
            raise error(f"config.json: {_describe(d, prefix)}{held}: {name} has shape {shape} ({n} along dim "
                        f"{axis}, the config implies {d.size}); config.json and the weights disagree")
