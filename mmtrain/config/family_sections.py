"""The model families' config sections, read from the family table (``mmtrain.models.families``).

Each family's package has a torch-free ``config`` module whose ``SECTION`` is its shape dataclass (a
``FamilySection``). The inline family's (Llama's) is the base of ``ModelConfig``, so its fields are
``model.*``; every other family's is composed into ``ModelConfig`` as ``model.<family>``
(``with_family_sections``). Nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal

from mmtrain.models.families import (
    FAMILY_PACKAGES,
    INLINE_FAMILY,
    FamilyContractError,
    FamilySection,
    family_names,
)

_SECTIONS: dict[str, type] = {}  # name -> section class, filled once per family from its config module


def section_class(name: str) -> type:
    """The config section class of family ``name`` (``<package>.config.SECTION``), checked against
    ``FamilySection``'s interface; ``FamilyContractError`` (one line) naming the module and member otherwise."""
    if name not in _SECTIONS:
        module_name = f"{FAMILY_PACKAGES[name]}.config"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not (exc.name == module_name or module_name.startswith(f"{exc.name}.")):
                raise  # the module is there; something it imports is not
            raise FamilyContractError(f"model family {name!r}: no module {module_name} (its config section; "
                                      "docs/adding-a-model-family.md)") from None
        cls = getattr(module, "SECTION", None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, FamilySection)):
            raise FamilyContractError(f"model family {name!r}: {module_name}.SECTION must be a dataclass deriving "
                                      f"from mmtrain.models.families.FamilySection (got {cls!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        absent = [m for m in FamilySection.SECTION_MEMBERS if m not in fields and not hasattr(cls, m)]
        if absent:
            raise FamilyContractError(f"model family {name!r}: {module_name}.{cls.__name__} lacks "
                                      f"{', '.join(absent)} (the section interface of FamilySection)")
        _SECTIONS[name] = cls
    return _SECTIONS[name]


def composed_families() -> tuple[str, ...]:
    """The families whose section is ``model.<name>`` (every one but the inline family), in table order."""
    return tuple(n for n in family_names() if n != INLINE_FAMILY)


def family_name_type() -> Any:
    """The annotation of ``model.family``: a string among the table's names (the loader refuses any other with
    one line listing them)."""
    return Literal[family_names()]


def with_family_sections(cls: type) -> type:
    """Class decorator (before ``@dataclass``): add one field ``<name>: <its section>`` per composed family,
    defaulting to the section's defaults."""
    if "__annotations__" not in cls.__dict__:  # a class body without annotations of its own
        cls.__annotations__ = {}
    for name in composed_families():
        section = section_class(name)
        cls.__annotations__[name] = section
        setattr(cls, name, dataclasses.field(default_factory=section, metadata={
            "help": f"The {name} family's shape ({FAMILY_PACKAGES[name]}.config), used when family is {name} "
                    "(else it keeps its defaults)."}))
    return cls


def section_fields(model: Any, name: str) -> dict[str, Any]:
    """Family ``name``'s shape fields as ``model`` holds them, by their key under the model section:
    ``hidden_size`` for the inline family, ``<name>.<field>`` for a composed one."""
    if name == INLINE_FAMILY:
        return {f.name: getattr(model, f.name) for f in dataclasses.fields(section_class(name))}
    section = getattr(model, name)
    return {f"{name}.{f.name}": getattr(section, f.name) for f in dataclasses.fields(section)}


def families_with(capability: str) -> tuple[str, ...]:
    """The families whose section declares ``capability`` (a ``FamilySection.CAPABILITIES`` name) true."""
    return tuple(n for n in family_names() if getattr(section_class(n), capability))
