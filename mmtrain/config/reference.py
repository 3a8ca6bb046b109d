"""Generate the configuration reference (docs/config-reference.md) from the config dataclasses.

    python -m mmtrain.config.reference > docs/config-reference.md

A test compares the committed file with this output, so the reference can never go stale.
"""

from __future__ import annotations

import dataclasses
import typing

from mmtrain.config.schema import GPTRunConfig


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return f"`{f.default!r}`"


def reference_markdown(root: type = GPTRunConfig) -> str:
    lines = ["# Configuration reference", "",
             "Generated from `mmtrain/config/schema.py` by `python -m mmtrain.config.reference`; do not edit by hand.",
             "Set any key in a YAML file (`section:` then `key: value`) or on the command line as `section.key=value`.",
             ""]
    hints = typing.get_type_hints(root)
    for section in dataclasses.fields(root):
        cls = hints[section.name]
        lines += [f"## `{section.name}` — {section.metadata.get('help', '')}", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        sub_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            lines.append(f"| `{section.name}.{f.name}` | {_type_name(sub_hints[f.name])} | {_default(f)} | "
                         f"{f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
