"""Writing a quantized model as a Hugging Face folder in the ``compressed-tensors`` format: the family's own HF
export for every name, the dense tensors, ``config.json`` and the tokenizer files (``mmtrain.convert``), each
quantized linear's values and scales split into the HF linears that hold its rows (``mmtrain.convert.linear_rows``)
and compressed by the library (``mmtrain.convert.compressed_tensors_format``), ``quantization_config`` added to
config.json, and ``mmtrain-quantization.json`` (what the folder was made from).

The folder is written whole into a temporary folder beside ``out`` and renamed into place; an earlier output
there (one that this command wrote: it holds ``mmtrain-quantization.json``) is moved aside only once the new one is
complete, and removed after the rename. Any other existing ``out`` is refused."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmtrain.convert.compressed_tensors_format import (
    QuantizedFolderError,
    QuantSpec,
    compressed_linear,
    quantization_config,
)
from mmtrain.convert.convert import export_config
from mmtrain.convert.hf_files import write_hf_folder
from mmtrain.convert.linear_rows import hf_linear_rows
from mmtrain.core.tokenizer import Tokenizer
from mmtrain.inference.quantized_loading import PROVENANCE_NAME
from mmtrain.models.registry import model_family
from mmtrain.utils.atomic import current_umask, fsync_dir


def check_output_folder(out: str | Path) -> None:
    """Refuse (one line) an ``out`` that exists and is not an earlier output of this command: it is replaced."""
    out = Path(out)
    if out.exists() and not (out / PROVENANCE_NAME).is_file():
        raise QuantizedFolderError(f"--out {out}: exists and is not a folder python -m mmtrain.quantize wrote (no "
                                   f"{PROVENANCE_NAME}); choose a new folder, or remove it")


def replace_folder(out: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(temporary folder)`` then the folder renamed to ``out``; an earlier ``out`` is moved aside only after
    ``write`` finished and removed after the rename (a crash leaves the old output or the new one at ``out``,
    and at worst a hidden ``.NAME.*`` folder beside it). Folder mode as ``mkdir`` gives (0o777 & ~umask)."""
    out = Path(out)
    check_output_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        write(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old / out.name, out)  # put the earlier output back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def quantized_hf_tensors(full: dict[str, torch.Tensor], cfg, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
                         spec: QuantSpec, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The folder's tensors: ``full`` (our dense state) through the family's HF export, each quantized linear
    (``quantized``: our module name -> (values, scales)) replaced by its compressed tensors under the HF names
    that hold its rows; floating dense tensors cast to ``dtype`` when given."""
    adapter = model_family(cfg).hf
    weights = {name + ".weight": values.shape[0] for name, (values, _) in quantized.items()}
    rows = hf_linear_rows(adapter.state_to_hf, cfg, full, weights)
    stand_ins = {k: (torch.empty(full[k].shape, device="meta") if k in weights else v) for k, v in full.items()}
    tensors = adapter.state_to_hf(stand_ins, cfg)
    for hf_name, (key, idx) in rows.items():
        del tensors[hf_name + ".weight"]
        values, scale = quantized[key.removesuffix(".weight")]
        for suffix, t in compressed_linear(values[idx], scale[idx], spec).items():
            tensors[f"{hf_name}.{suffix}"] = t.contiguous().cpu()
    left = [k for k, t in tensors.items() if t.device.type == "meta"]
    if left:
        raise QuantizedFolderError(f"{left[0]}: the HF export computes it from a quantized linear's weight; this "
                                   "family's linears cannot be quantized")
    if dtype is not None:
        tensors = {k: t.to(dtype) if t.is_floating_point() and not k.endswith(".weight_scale")
                   and t.dtype != torch.float8_e4m3fn else t for k, t in tensors.items()}
    return tensors


def write_quantized_folder(out: str | Path, tensors: dict[str, torch.Tensor], dense_dtype: torch.dtype, cfg,
                           meta: dict[str, Any], spec: QuantSpec, tok: Tokenizer | None,
                           tokenizer_files: dict[str, bytes], provenance: dict[str, Any]) -> Path:
    """``out`` as a compressed-tensors HF folder (see the module docstring) whose dense tensors are
    ``dense_dtype``; returns it."""
    hf_config = export_config(cfg, meta, dense_dtype, tok)
    hf_config["quantization_config"] = quantization_config(spec)
    extra = {**tokenizer_files, PROVENANCE_NAME: (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode()}
    return replace_folder(out, lambda tmp: write_hf_folder(tmp, hf_config, tensors, extra_files=extra))
