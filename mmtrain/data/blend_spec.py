"""Blend-spec files: which datasets, with which weights, feed each split (format: docs/blend-spec.md).

A spec is YAML with either one blend split by document ranges::

    split: 969,30,1              # optional; else data.split
    datasets:
      - {path: wiki, weight: 0.7}          # an indexed prefix (PREFIX.bin/.idx), relative to this file
      - {path: code, weight: 0.3}

or one blend per split (each dataset used whole)::

    train: [{path: wiki_train, weight: 2}, {path: code_train, weight: 1}]
    valid: "1 wiki_valid"                  # Megatron's list form: weight path weight path ...
    test:  [1, wiki_test]                  # the same as a YAML list

Entries may say ``type: energon`` (a prepared multimodal shard folder); they are parsed and checked here; GPT
text training rejects them and the multimodal loader (``mmtrain.data.multimodal_loader``) reads them. Weights are normalized per split; leaving every weight out weighs each
dataset by its token count in the split. Everything wrong is a ``BlendSpecError`` naming the file and entry.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmtrain.core.indexed import IndexedDataset, IndexedFormatError, bin_path, idx_path
from mmtrain.core.manifest import ManifestError, read_prefix_manifest

SPLIT_KEYS = ("train", "valid", "test")
ENTRY_KEYS = {"path", "weight", "type"}
ENTRY_TYPES = ("indexed", "energon")


class BlendSpecError(ValueError):
    """A blend spec (or data.prefixes) that cannot be used; the message names the file/key and the fix."""


@dataclass(frozen=True)
class BlendEntry:
    path: str  # absolute prefix (indexed) or folder (energon)
    weight: float | None  # None: weigh by token count
    type: str
    where: str  # "spec.yaml: train[1]" -- for messages


@dataclass
class BlendSpec:
    source: str
    datasets: list[BlendEntry] | None  # one blend split by data.split / self.split
    per_split: dict[str, list[BlendEntry]] | None  # or one blend per split
    split: str | None = None

    def entries_for(self, split: str) -> list[BlendEntry]:
        if self.per_split is not None:
            return self.per_split.get(split, [])
        return list(self.datasets or [])


def _weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BlendSpecError(f"{where}: weight {value!r} is not a number")
    try:
        w = float(value)
    except ValueError:
        raise BlendSpecError(f"{where}: weight {value!r} is not a number") from None
    if not math.isfinite(w) or w <= 0:
        raise BlendSpecError(f"{where}: weight {value!r} must be a positive number")
    return w


def _resolve(path, base_dir: Path | None, where: str) -> str:
    if not isinstance(path, str) or not path.strip():
        raise BlendSpecError(f"{where}: path must be a non-empty string, got {path!r}")
    p = Path(os.path.expanduser(path.strip()))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return os.path.abspath(p)


def _is_number(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False


def _parse_megatron_list(items: list, base_dir: Path | None, where: str) -> list[BlendEntry]:
    """``[w1, p1, w2, p2, ...]`` (or paths only, weighed by tokens) -> entries."""
    if not items:
        raise BlendSpecError(f"{where}: empty blend")
    if _is_number(items[0]):
        if len(items) % 2:
            raise BlendSpecError(f"{where}: Megatron's list form alternates weight and path, but it has "
                                 f"{len(items)} items (an odd count): {items!r}")
        return [BlendEntry(_resolve(items[i + 1], base_dir, f"{where}[{i + 1}]"),
                           _weight(items[i], f"{where}[{i}]"), "indexed", f"{where}[{i + 1}]")
                for i in range(0, len(items), 2)]
    bad = [x for x in items if _is_number(x) or not isinstance(x, str)]
    if bad:
        raise BlendSpecError(f"{where}: mixes paths and weights; write 'weight path weight path ...' "
                             f"or only paths, got {items!r}")
    return [BlendEntry(_resolve(p, base_dir, f"{where}[{i}]"), None, "indexed", f"{where}[{i}]")
            for i, p in enumerate(items)]


def _parse_blend(value, base_dir: Path | None, where: str) -> list[BlendEntry]:
    """A blend as a list of ``{path, weight, type}`` mappings, a Megatron list, or a Megatron string."""
    if isinstance(value, str):
        return _parse_megatron_list(value.split(), base_dir, where)
    if not isinstance(value, list) or not value:
        raise BlendSpecError(f"{where}: expected a non-empty list of datasets or a 'weight path ...' string, "
                             f"got {value!r}")
    if not any(isinstance(x, dict) for x in value):
        return _parse_megatron_list(value, base_dir, where)
    entries = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise BlendSpecError(f"{at}: expected a mapping like {{path: ..., weight: ...}}, got {item!r}")
        unknown = sorted(set(item) - ENTRY_KEYS)
        if unknown:
            raise BlendSpecError(f"{at}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(ENTRY_KEYS))}")
        if "path" not in item:
            raise BlendSpecError(f"{at}: missing 'path'")
        kind = item.get("type", "indexed")
        if kind not in ENTRY_TYPES:
            raise BlendSpecError(f"{at}: type {kind!r} is not one of {', '.join(ENTRY_TYPES)}")
        weight = _weight(item["weight"], at) if "weight" in item else None
        entries.append(BlendEntry(_resolve(item["path"], base_dir, at), weight, kind, at))
    return entries


def _check_entries(entries: list[BlendEntry], where: str) -> None:
    """Weights all given or all left out; no dataset twice; every prefix/folder exists."""
    given = [e.weight is not None for e in entries]
    if any(given) and not all(given):
        missing = next(e for e in entries if e.weight is None)
        raise BlendSpecError(f"{missing.where}: no weight while other entries of {where} have one; give every "
                             "entry a weight or none (none weighs datasets by token count)")
    seen: dict[str, str] = {}
    for e in entries:
        if e.path in seen:
            raise BlendSpecError(f"{e.where}: {e.path} is listed twice in {where} (also at {seen[e.path]}); "
                                 "list it once with the summed weight")
        seen[e.path] = e.where
        if e.type == "energon":
            if not os.path.isdir(e.path):
                raise BlendSpecError(f"{e.where}: energon dataset folder {e.path} not found")
        else:
            missing = [str(p) for p in (idx_path(e.path), bin_path(e.path)) if not p.is_file()]
            if missing:
                base = ("the folder the run starts in; make it with mmtrain-prep text" if where == "data.prefixes"
                        else "the spec file")
                raise BlendSpecError(f"{e.where}: indexed dataset {e.path} not found (missing {', '.join(missing)}); "
                                     f"give the prefix without .bin/.idx, relative to {base}")


def load_blend_spec(path: str | os.PathLike) -> BlendSpec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlendSpecError(f"{path}: blend spec not found (data.blend; looked for {path.resolve()})") from None
    except yaml.YAMLError as exc:
        raise BlendSpecError(f"{path}: not valid YAML ({exc})") from None
    if isinstance(raw, (str, list)):  # a bare Megatron blend
        raw = {"datasets": raw}
    if not isinstance(raw, dict):
        raise BlendSpecError(f"{path}: expected a mapping with 'datasets' or 'train'/'valid'/'test'")
    allowed = {"datasets", "split", *SPLIT_KEYS}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise BlendSpecError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    base = path.parent.resolve()
    has_splits = [k for k in SPLIT_KEYS if k in raw]
    if "datasets" in raw and has_splits:
        raise BlendSpecError(f"{path}: give either 'datasets' (split by document ranges) or per-split blends "
                             f"({', '.join(has_splits)}), not both")
    if "datasets" in raw:
        datasets = _parse_blend(raw["datasets"], base, f"{path}: datasets")
        _check_entries(datasets, f"{path}: datasets")
        split = raw.get("split")
        return BlendSpec(str(path), datasets, None, None if split is None else str(split))
    if not has_splits:
        raise BlendSpecError(f"{path}: no datasets; add 'datasets:' or a 'train:' blend")
    if "split" in raw:
        raise BlendSpecError(f"{path}: 'split' only applies to 'datasets'; per-split blends use each dataset whole")
    per_split = {}
    for k in has_splits:
        per_split[k] = _parse_blend(raw[k], base, f"{path}: {k}")
        _check_entries(per_split[k], f"{path}: {k}")
    return BlendSpec(str(path), None, per_split)


def blend_from_prefixes(prefixes: list[str], weights: list[float]) -> BlendSpec:
    """``data.prefixes`` (+ optional ``data.weights``, or Megatron's list form in prefixes) as a spec."""
    where = "data.prefixes"
    if weights:
        if len(weights) != len(prefixes):
            raise BlendSpecError(f"data.weights has {len(weights)} values for {len(prefixes)} data.prefixes")
        items: list = [x for w, p in zip(weights, prefixes) for x in (w, p)]
    else:
        items = list(prefixes)
    entries = _parse_megatron_list(items, Path.cwd(), where)
    _check_entries(entries, where)
    return BlendSpec(where, entries, None)


# ---- manifests: tokenizer identity, vocabulary bound, EOD id -------------------------------------------------

def _read_prefix_manifest(prefix: str) -> dict | None:
    try:
        return read_prefix_manifest(prefix)
    except ManifestError as exc:
        raise BlendSpecError(str(exc)) from None


@dataclass(frozen=True)
class _TextDatasetInfo:
    prefix: str
    where: str
    tokenizer: dict | None
    eod_id: int | None


def _describe_text_dataset(entry: BlendEntry) -> _TextDatasetInfo:
    manifest = _read_prefix_manifest(entry.path) or {}
    tok = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else None
    eod = manifest.get("eod_id")
    if eod is None and tok is not None and manifest.get("append_eod", True):
        eod = tok.get("eod_id")
    return _TextDatasetInfo(entry.path, entry.where, tok, None if eod is None else int(eod))


def check_text_datasets(entries: list[BlendEntry], vocab_size: int, log) -> list[_TextDatasetInfo]:
    """Open every dataset (format errors named), and check tokenizers agree and ids fit the vocabulary."""
    infos = []
    for e in entries:
        if e.type == "energon":
            raise BlendSpecError(f"{e.where}: {e.path} is an energon (multimodal) dataset; GPT text training "
                                 "does not support energon datasets yet -- remove it from this blend")
        try:
            IndexedDataset(e.path)
        except IndexedFormatError as exc:
            raise BlendSpecError(f"{e.where}: {exc}") from None
        info = _describe_text_dataset(e)
        if info.tokenizer is None:
            log.warning("%s: no manifest naming a tokenizer for %s; its tokenizer and vocabulary cannot be "
                        "checked", e.where, e.path)
        infos.append(info)
    known = [i for i in infos if i.tokenizer is not None]
    for i in known:
        if _tokenizer_id(i.tokenizer) != _tokenizer_id(known[0].tokenizer):
            raise BlendSpecError(f"{i.where}: {i.prefix} was tokenized with {_tokenizer_name(i.tokenizer)} but "
                                 f"{known[0].where} with {_tokenizer_name(known[0].tokenizer)}; a blend needs one "
                                 "tokenizer -- re-prepare one of them")
        max_id = i.tokenizer.get("max_id")
        if max_id is not None and int(max_id) >= vocab_size:
            raise BlendSpecError(f"{i.where}: {i.prefix} holds token ids up to {max_id} but model.vocab_size is "
                                 f"{vocab_size}; set model.vocab_size to at least {int(max_id) + 1}")
    return infos


def manifest_tokenizer(entries: list[BlendEntry]) -> dict | None:
    """The tokenizer record the first of ``entries``' manifests that names one holds (None: none does)."""
    for e in entries:
        if e.type != "energon":
            tok = _describe_text_dataset(e).tokenizer
            if tok is not None:
                return tok
    return None


def _tokenizer_id(tok: dict):
    return tok.get("sha256") or (tok.get("type"), tok.get("path"))


def _tokenizer_name(tok: dict) -> str:
    digest = (tok.get("sha256") or "")[:12]
    return f"{tok.get('type')} tokenizer {tok.get('path')} (sha256 {digest}...)"
