"""Lazy public names of a package: ``import mmtrain.data`` stays cheap (no torch) until a name is used."""

from __future__ import annotations

import importlib
from typing import Any


def lazy_exports(package: str, names: dict[str, str], namespace: dict[str, Any]):
    """``__getattr__`` and ``__dir__`` for a package whose public ``names`` live in the given modules."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module '{package}' has no attribute '{name}'")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
