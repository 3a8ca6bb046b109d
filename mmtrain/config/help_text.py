"""Plain-text help of a run config for the entry points' ``--help`` and ``--help-config SECTION``.

Generated from the same dataclasses as docs/config-reference.md (help text, default, range), with no torch
import, so ``--help`` answers at once.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing

from mmtrain.config.loader import ConfigError
from mmtrain.config.ranges import range_text

_WIDTH = 110


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "dict[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _first_sentence(text: str) -> str:
    text = " ".join(text.replace("``", "`").split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted name, dataclass, one-line doc) of every section of ``cls``, nested ones after their parent."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = hints[f.name]
            line = _first_sentence(sub.__doc__ or "") or f.metadata.get("help", "")
            out.append((prefix + f.name, sub, line))
            out.extend(_sections(sub, prefix + f.name + "."))
    return out


def _leaf_fields(cls: type) -> list[dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]


def sections_overview(cls: type) -> str:
    """Every section of the run config ``cls``: its one-line doc and its keys (top-level keys first)."""
    lines = []
    top = [f.name for f in _leaf_fields(cls)]
    indent = " " * 6
    if top:
        lines.append("  (top level)")
        lines += textwrap.wrap(" ".join(top), _WIDTH, initial_indent=indent, subsequent_indent=indent)
    for name, sub, doc_line in _sections(cls):
        lines += textwrap.wrap(f"{name}: {doc_line}", _WIDTH, initial_indent="  ", subsequent_indent="    ")
        keys = " ".join(f.name for f in _leaf_fields(sub))
        lines += textwrap.wrap(keys, _WIDTH, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)


def section_help(cls: type, section: str) -> str:
    """Each key of ``section`` (dotted, e.g. ``optim`` or ``model.vision``; ``top`` for top-level keys) with its
    type, default, range and help text. ``ConfigError`` naming the known sections for an unknown one."""
    known = {name: sub for name, sub, _ in _sections(cls)}
    if section in ("top", "") and _leaf_fields(cls):
        sub, prefix, title = cls, "", "top-level keys"
    elif section in known:
        sub, prefix = known[section], section + "."
        title = f"{section}: {_first_sentence(sub.__doc__ or '')}"
    else:
        names = ", ".join(([] if not _leaf_fields(cls) else ["top"]) + list(known))
        raise ConfigError(f"--help-config {section}: no such config section; sections: {names}")
    hints = typing.get_type_hints(sub)
    lines = [title, ""]
    for f in _leaf_fields(sub):
        bounds = range_text(f.metadata)
        head = f"  {prefix}{f.name}  ({_type_name(hints[f.name])}, default {_default(f)!r}"
        head += f", range {bounds})" if bounds else ")"
        lines.append(head)
        text = f.metadata.get("help", "").replace("``", "`")
        lines += textwrap.wrap(text, _WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    nested = [f.name for f in dataclasses.fields(sub) if dataclasses.is_dataclass(hints[f.name])]
    if nested:
        lines += ["", "  sections inside: " + ", ".join(f"{prefix}{n} (--help-config {prefix}{n})" for n in nested)]
    return "\n".join(lines)
