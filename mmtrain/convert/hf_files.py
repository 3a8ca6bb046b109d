"""Reading and writing a Hugging Face model folder: ``config.json`` plus safetensors weights, either one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``.

safetensors files carry no checksum, so an export writes ``mmtrain-checksums.json`` (XXH3 hash and size of every
file, ``mmtrain.utils.file_checksums``) and a read checks the files against it when it is there. A file that is
not what the folder says (bad JSON, a shard name outside the folder, a safetensors header that does not fit the
file) is an ``HFFolderError`` naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mmtrain.utils.atomic import atomic_write_bytes, atomic_write_text
from mmtrain.utils.file_checksums import entry_of_bytes, file_problem, read_record, record_text

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CHECKSUMS_NAME = "mmtrain-checksums.json"


class HFFolderError(ValueError):
    """A Hugging Face folder whose files are missing, damaged or inconsistent; the message names the file."""


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("the Hugging Face bridge needs the safetensors package: pip install safetensors") from None
    return safetensors.torch


def _checked(folder: Path, name: str, verify: bool) -> Path:
    """``folder/name``, checked against the folder's checksum record when it has one (and ``verify``)."""
    path = folder / name
    if not verify:
        return path
    try:
        record = read_record(folder / CHECKSUMS_NAME)
    except ValueError as exc:
        raise HFFolderError(str(exc)) from None
    if record is not None:
        if name not in record:
            raise HFFolderError(f"{path}: not in {folder / CHECKSUMS_NAME} (a file added after the export?)")
        problem = file_problem(path, record[name])
        if problem:
            raise HFFolderError(f"{path} {problem}; export or download the folder again (or delete "
                                f"{CHECKSUMS_NAME} if the file was changed on purpose)")
    return path


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFFolderError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise HFFolderError(f"{path}: not a JSON object")
    return value


def read_hf_config(folder: str | Path, verify: bool = True) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the Hugging Face folder")
    return _json_object(_checked(Path(folder), "config.json", verify))


def _shard_files(folder: Path, index: Path, verify: bool) -> list[str]:
    weight_map = _json_object(_checked(folder, INDEX_NAME, verify)).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFFolderError(f"{index}: no 'weight_map' of tensor names to files")
    files = sorted(set(weight_map.values()))
    for name in files:  # confined to the folder: an index may not point a read anywhere else
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise HFFolderError(f"{index}: weight_map names {name!r}, not a .safetensors file name in the folder")
        if not (folder / name).is_file():
            raise HFFolderError(f"{index}: lists {name}, which is missing from {folder}")
    return files


def _check_header(path: Path) -> None:
    """A header that does not fit the file is a one-line error."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
    if header_len < 2 or 8 + header_len > size:
        raise HFFolderError(f"{path}: its header length does not fit the file's {size} bytes (truncated, or not a "
                            "safetensors file?)")


def _load_safetensors(path: Path, lazy: bool = False) -> dict[str, Any]:
    """The tensors of one safetensors file (``lazy``: as ``LazyTensor``s, only the header read)."""
    _check_header(path)
    try:
        if lazy:
            from mmtrain.convert.lazy_tensors import lazy_safetensors

            return lazy_safetensors(path)
        return _safetensors().load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors' own errors (header, offsets, sizes) name no file
        raise HFFolderError(f"{path}: not a valid safetensors file ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); export or download it again") from None


def read_hf_tensors(folder: str | Path, verify: bool = True, lazy: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of the folder, keyed by HF name (sharded or single-file safetensors); with ``verify``, each
    file is checked against ``mmtrain-checksums.json`` when the folder has one. ``lazy``: ``LazyTensor``s
    (``mmtrain.convert.lazy_tensors``) that read only what is used of them, e.g. one tensor-parallel shard."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        files = _shard_files(folder, index, verify)
    elif (folder / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        found = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {found[:3]}: PyTorch .bin weights are not read, re-save them as safetensors)" if found else ""
        raise FileNotFoundError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        for key, t in _load_safetensors(_checked(folder, name, verify), lazy).items():
            if key in tensors:
                raise HFFolderError(f"{folder / name}: tensor {key} is in another file of the folder too")
            tensors[key] = t
    return tensors


def _config_json(config: Any) -> Any:
    """``config`` with each infinite or NaN float as transformers writes it into config.json (its JSON stays
    strict): ``{"__float__": "Infinity"}``, which transformers reads back as the float."""
    if isinstance(config, float) and not math.isfinite(config):
        return {"__float__": "NaN" if math.isnan(config) else ("Infinity" if config > 0 else "-Infinity")}
    if isinstance(config, dict):
        return {key: _config_json(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [_config_json(value) for value in config]
    return config


def write_hf_folder(folder: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    max_shard_bytes: int = 5 * 2**30, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``config.json`` (an infinite float as transformers writes it), ``extra_files`` (name -> bytes:
    tokenizer files, generation_config.json), the weights, sharded (with an index) past ``max_shard_bytes``, and
    ``mmtrain-checksums.json`` (every file); every file is written atomically, the index or single file last so a
    reader never sees a partial set."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    reserved = {"config.json", CHECKSUMS_NAME, SINGLE_NAME, INDEX_NAME}
    for name in extra_files or {}:
        if Path(name).name != name or name in reserved or name.endswith(".safetensors"):
            raise ValueError(f"extra file name {name!r}: not a plain file name of its own in the folder")
    st = _safetensors()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    config_text = json.dumps(_config_json(config), indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write_text(folder / "config.json", config_text)
    sums = {"config.json": entry_of_bytes(config_text.encode("utf-8"))}
    for name, data in sorted((extra_files or {}).items()):
        atomic_write_bytes(folder / name, data)
        sums[name] = entry_of_bytes(data)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        data = st.save(shards[0], metadata=metadata)
        sums[SINGLE_NAME] = entry_of_bytes(data)
        atomic_write_text(folder / CHECKSUMS_NAME, record_text(sums))
        atomic_write_bytes(folder / SINGLE_NAME, data)
        return folder
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = st.save(shard, metadata=metadata)
        sums[file] = entry_of_bytes(data)
        atomic_write_bytes(folder / file, data)
        del data
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
                            sort_keys=True) + "\n"
    sums[INDEX_NAME] = entry_of_bytes(index_text.encode("utf-8"))
    atomic_write_text(folder / CHECKSUMS_NAME, record_text(sums))  # before the index: the set is complete with it
    atomic_write_text(folder / INDEX_NAME, index_text)
    return folder


def write_peft_adapter(folder: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """A ``peft`` adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (atomic, the weights
    last), what ``peft.PeftModel.from_pretrained(base, folder)`` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    data = _safetensors().save({k: v.contiguous() for k, v in sorted(tensors.items())}, metadata={"format": "pt"})
    atomic_write_bytes(folder / "adapter_model.safetensors", data)
    return folder
