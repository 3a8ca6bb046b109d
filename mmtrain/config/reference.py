"""Generate the configuration reference (docs/config-reference.md) from the config dataclasses.

    python -m mmtrain.config.reference > docs/config-reference.md

A test compares the committed file with this output, so the reference can never go stale.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from mmtrain.config.ranges import range_text
from mmtrain.config.schema import GPTRunConfig, RunSections


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "dict[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    if origin in (typing.Union, types.UnionType):  # ``float | None``: a bare "|" would split the table's cell
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return f"`{f.default!r}`"


def _range(f: dataclasses.Field) -> str:
    """The declared bounds (``mmtrain.config.ranges``); floats are also always finite."""
    text = range_text(f.metadata)
    return text.replace("<", "&lt;").replace(">", "&gt;") if text else ""


def _section(lines: list[str], key: str, cls: type, help_text: str) -> None:
    """One table per dataclass section; nested sections (the VLM's ``model.vision``) follow as their own."""
    lines += [f"## `{key}` — {help_text}", "", (cls.__doc__ or "").strip(), "",
              "| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append(f)
            lines.append(f"| `{key}.{f.name}` | section | | | {f.metadata.get('help', '')} (below) |")
            continue
        lines.append(f"| `{key}.{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {_range(f)} | "
                     f"{f.metadata.get('help', '')} |")
    lines.append("")
    for f in nested:
        _section(lines, f"{key}.{f.name}", hints[f.name], f.metadata.get("help", ""))


def reference_markdown(root: type = GPTRunConfig, with_vlm: bool = True) -> str:
    lines = ["# Configuration reference", "",
             "Generated from `mmtrain/config/schema.py` (and `vlm_schema.py`, `media_schema.py`, "
             "`vlm_run_schema.py`; the model families' sections from `mmtrain/models/<family>/config.py`) by "
             "`python -m mmtrain.config.reference`; do not edit by hand.",
             "Set any key in a YAML file (`section:` then `key: value`) or on the command line as `section.key=value`.",
             "A value outside its range (a list: each element; a mapping: each value), or a float that is NaN or "
             "infinite, is an error naming the key before anything starts.",
             ""]
    hints = typing.get_type_hints(root)
    for section in dataclasses.fields(root):
        _section(lines, section.name, hints[section.name], section.metadata.get("help", ""))
    text = "\n".join(lines)
    return text + "\n" + _vlm_reference_markdown() if with_vlm and root is GPTRunConfig else text


def _vlm_reference_markdown() -> str:
    """The VLM run config: its model sections and top-level keys; the other sections are the GPT run's."""
    from mmtrain.config.vlm_run_schema import VLMRunConfig

    lines = ["# VLM run (`python -m mmtrain.pretrain_vlm`)", "",
             ("`VLMRunConfig` (`mmtrain/config/vlm_run_schema.py`) extends the same `RunSections` as the GPT run: "
              "`parallel`, `data`, `optim`, `train`, `logging` and `checkpoint` are the sections above. Its `model` "
              "is the VLM's, `media` says how media samples are read (image size, placeholder ids and counts and "
              "the audio rate come from `model`, never set twice), and top-level keys choose what trains and from "
              "which weights."), ""]
    hints = typing.get_type_hints(VLMRunConfig)
    gpt = {f.name for f in dataclasses.fields(RunSections)}
    top = []
    for f in dataclasses.fields(VLMRunConfig):
        if f.name in gpt:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            _section(lines, f.name, hints[f.name], f.metadata.get("help", ""))
        else:
            top.append(f)
    lines += ["## Top-level keys", "", "| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {_range(f)} | "
              f"{f.metadata.get('help', '')} |" for f in top]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
