"""Reading and writing a Hugging Face model folder: ``config.json`` plus safetensors weights, either one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmtrain.utils.atomic import atomic_write_bytes, atomic_write_text

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("the Hugging Face bridge needs the safetensors package: pip install safetensors") from None
    return safetensors.torch


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the Hugging Face folder")
    return json.loads(path.read_text(encoding="utf-8"))


def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder, keyed by HF name (sharded or single-file safetensors)."""
    folder = Path(folder)
    st = _safetensors()
    index = folder / INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        found = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {found[:3]}: PyTorch .bin weights are not read, re-save them as safetensors)" if found else ""
        raise FileNotFoundError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(st.load_file(str(folder / name)))
    return tensors


def write_hf_folder(folder: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``config.json`` and the weights, sharded (with an index) past ``max_shard_bytes``; every file is
    written atomically, the index or single file last so a reader never sees a partial set."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
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
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    metadata = {"format": "pt"}
    if len(shards) == 1:
        atomic_write_bytes(folder / SINGLE_NAME, st.save(shards[0], metadata=metadata))
        return folder
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write_bytes(folder / file, st.save(shard, metadata=metadata))
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    atomic_write_text(folder / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                      indent=2, sort_keys=True) + "\n")
    return folder
