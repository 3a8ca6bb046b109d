"""Build a config object: dataclass defaults, then YAML file(s), then dotted ``key=value`` overrides.

Strict by design: an unknown key, a value of the wrong type or an include cycle is a ``ConfigError`` that
names the key (with the closest valid key) and where it came from. Nothing is silently dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from mmtrain.utils.atomic import atomic_write_text


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says what and where."""


INCLUDE_KEY = "include"
BUNDLED_PREFIX = "mmtrain:"  # `mmtrain:configs/gpt/tiny_cpu.yaml`: the configs/ shipped with mmtrain, from any folder


def bundled_root() -> Path:
    """The folder holding the ``configs/`` that came with this mmtrain: the source checkout (``pip install -e``)
    or, in an installed wheel, the package itself."""
    package = Path(__file__).resolve().parents[1]
    return package.parent if (package.parent / "configs").is_dir() else package


def resolve_config_path(path: str | os.PathLike, base: Path | None = None) -> Path:
    """A config path as written: ``mmtrain:REL`` is REL under ``bundled_root()``; another relative path is
    relative to ``base`` (the including file's folder), or to the working folder without one."""
    text = os.fspath(path)
    if text.startswith(BUNDLED_PREFIX):
        return bundled_root() / text[len(BUNDLED_PREFIX):]
    return Path(text) if base is None else base / text


# ---------------------------------------------------------------------------------------------- YAML files
def read_yaml_with_includes(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping; files named under ``include:`` (a path or list, relative to this file, or
    ``mmtrain:configs/...`` for the bundled configs) load first and this file's keys are merged on top of them,
    recursively for nested mappings."""
    original, path = path, resolve_config_path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"include cycle: {cycle}")
    if not path.is_file():
        where = f" (included from {_chain[-1]})" if _chain else ""
        hint = ""
        text = os.fspath(original)
        if not text.startswith(BUNDLED_PREFIX) and not os.path.isabs(text) and (bundled_root() / text).is_file():
            hint = f"; the bundled one is {BUNDLED_PREFIX}{text} (found from any folder)"
        raise ConfigError(f"config file not found: {path}{where}{hint}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    includes = data.pop(INCLUDE_KEY, [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: '{INCLUDE_KEY}' must be a path or a list of paths")
    merged: dict[str, Any] = {}
    for inc in includes:
        merged = _deep_merge(merged, read_yaml_with_includes(resolve_config_path(inc, path.parent), (*_chain, path)))
    return _deep_merge(merged, data)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------- overlay onto objects
def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        ftype = typing.get_type_hints(cls)[f.name]
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(ftype):
            keys.extend(_all_keys(ftype, prefix + f.name + "."))
    return keys


def _unknown_key_error(key: str, root_cls: type, source: str) -> ConfigError:
    moved = getattr(root_cls, "MOVED_KEYS", {})  # keys of earlier versions: say what replaced them
    if key in moved:
        return ConfigError(f"unknown config key '{key}' in {source}: {moved[key]}")
    valid = _all_keys(root_cls)
    close = _abbreviated_sibling(key, valid) or difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # compare on the last component too: `model.n_groups` vs `model.deepseek_v3.n_group`
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in valid}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}' in {source}{hint}")


def _abbreviated_sibling(key: str, valid: list[str]) -> list[str]:
    """[the key of the same section that abbreviates ``key``'s name by the initials of its trailing words]:
    ``optim.learning_rate`` -> ``optim.lr``, ``optim.min_learning_rate`` -> ``optim.min_lr`` (spelling
    similarity would pick ``optim.min_lr`` for the first: more letters in common than ``lr``)."""
    section, _, leaf = key.rpartition(".")
    words = [w for w in leaf.split("_") if w]
    forms = {"_".join([*words[:i], "".join(w[0] for w in words[i:])]) for i in range(len(words) - 1)}
    return [k for k in valid if k.rpartition(".")[0] == section and k.rpartition(".")[2] in forms][:1]


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; numbers written as strings (YAML reads ``1e-4`` as a
    string) are accepted for numeric fields. Returns the value converted to the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"config key '{key}' in {source}: expected {expected}, got {value!r} ({type(value).__name__})")

    if tp is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise bad("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise bad(" or ".join(getattr(a, "__name__", str(a)) for a in args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            example = value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "a, b"
            raise ConfigError(f"config key '{key}' in {source}: expected a list, got {value!r} "
                              f"({type(value).__name__}); write it in brackets: {key}=[{example}] on the command "
                              f"line, {key.rsplit('.', 1)[-1]}: [{example}] in a YAML file (several: [a, b])")
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad("a mapping")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}", source) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if tp is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise bad("an integer")
    if tp is float:
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    raise ConfigError(f"config key '{key}': unsupported field type {tp!r} (a bug in mmtrain)")


def apply_mapping(obj: Any, mapping: dict[str, Any], source: str, root_cls: type | None = None, prefix: str = "") -> None:
    """Overlay a nested mapping onto a dataclass instance, in place."""
    root_cls = root_cls or type(obj)
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in mapping.items():
        dotted = prefix + str(key)
        if key not in names:
            raise _unknown_key_error(dotted, root_cls, source)
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{dotted}' in {source} is a section; give a mapping of its keys")
            apply_mapping(getattr(obj, key), value, source, root_cls, dotted + ".")
        else:
            setattr(obj, key, _coerce(value, ftype, dotted, source))


def _parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", parsed value). Values are read as YAML scalars/lists (``[1,2]``, ``true``)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. optim.lr=1e-4)")
    key, raw = text.split("=", 1)
    key = key.strip().removeprefix("--")
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _apply_override(obj: Any, key: str, value: Any) -> None:
    nested: dict[str, Any] = {}
    cursor = nested
    parts = key.split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    apply_mapping(obj, nested, f"command-line override '{key}={value}'")


def load_config(cls: type, config_file: str | os.PathLike | None = None, overrides: list[str] = ()) -> Any:
    """Defaults of ``cls``, then ``config_file`` (with its includes), then each ``key=value`` override."""
    cfg = cls()
    if config_file:
        apply_mapping(cfg, read_yaml_with_includes(config_file), str(config_file))
    for item in overrides:
        _apply_override(cfg, *_parse_override(item))
    return cfg


def _config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML (atomically); loading it back gives an equal object."""
    text = "# Resolved mmtrain config: defaults + config file + overrides.\n"
    text += yaml.safe_dump(_config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    return atomic_write_text(path, text)
