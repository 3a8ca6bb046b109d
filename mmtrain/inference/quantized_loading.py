"""A quantized Hugging Face folder (``compressed-tensors`` FP8 or W4A16, what ``python -m mmtrain.quantize`` writes)
ready to decode with mmtrain's own model: ``mmtrain.generate`` / ``mmtrain.serve`` take such a folder as ``--ckpt``.

The family is found from ``config.json`` (``model_type``) and its shape read by its HF adapter, as ``hf-to-mmtrain``
does; the dense tensors (embedding, norms, output layer) go through the adapter's ``state_from_hf``; each quantized
HF linear's values and scales are put back into our linears row by row (``mmtrain.convert.linear_rows``: the rows
the family's export takes from each of our linears), and each of our quantized linears becomes a
``QuantizedLinear`` (``mmtrain.model.quantized_linear``) in the module tree. One process (no tensor parallelism:
``mmtrain.inference.loading`` refuses a quantized folder under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmtrain.config.schema import ModelConfig
from mmtrain.convert.compressed_tensors_format import (
    STORED_SUFFIXES,
    QuantizedFolderError,
    QuantSpec,
    check_quantizable,
    linear_values,
    spec_of_config,
)
from mmtrain.convert.hf_files import HFFolderError, read_hf_config, read_hf_tensors
from mmtrain.convert.linear_rows import hf_linear_rows
from mmtrain.inference.decoder import check_decodable
from mmtrain.model.quantized_linear import QuantizedLinear, quantizable_linears
from mmtrain.models.registry import family_for_hf, hf_errors, model_family

PROVENANCE_NAME = "mmtrain-quantization.json"  # what mmtrain.quantize made the folder from (scheme, tokenizer)


def is_quantized_folder(path: str | Path) -> bool:
    """Whether ``path`` is an HF folder whose config.json declares a ``quantization_config``."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return isinstance(json.loads(config.read_text(encoding="utf-8")).get("quantization_config"), dict)
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def folder_provenance(folder: str | Path) -> dict[str, Any]:
    """The folder's ``mmtrain-quantization.json`` (empty when another tool made the folder)."""
    path = Path(folder) / PROVENANCE_NAME
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuantizedFolderError(f"{path}: not valid JSON ({exc})") from None
    return value if isinstance(value, dict) else {}


def quantized_folder_config(folder: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(the model config of quantized folder ``folder``, a complete.json-like record of it: the ``tokenizer`` and
    the source run's ``config.data`` that ``mmtrain-quantization.json`` keeps, empty for another tool's folder),
    read without the weights: what generation's tokenizer check and evaluation's data settings read."""
    folder = Path(folder)
    try:
        hf_config = read_hf_config(folder)
        spec_of_config(hf_config, str(folder / "config.json"))
        adapter = family_for_hf(hf_config).hf
        cfg = adapter.config_from_hf({k: v for k, v in hf_config.items() if k != "quantization_config"})
    except KeyError as exc:
        raise QuantizedFolderError(f"{folder / 'config.json'}: no {exc.args[0]!r}") from None
    except (HFFolderError, *hf_errors()) as exc:
        raise QuantizedFolderError(str(exc)) from None
    record = folder_provenance(folder)
    return cfg, {k: record[k] for k in ("tokenizer", "config") if k in record}


def _grouped(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                                      dict[str, torch.Tensor]]:
    """(HF linear name -> its stored tensors by suffix, the other tensors): a linear is what has a weight_scale."""
    linears = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    stored: dict[str, dict[str, torch.Tensor]] = {name: {} for name in linears}
    dense = {}
    for key, t in tensors.items():
        owner, _, suffix = key.rpartition(".")
        if owner in stored and suffix in STORED_SUFFIXES[spec.scheme]:
            stored[owner][suffix] = t
        else:
            dense[key] = t
    return stored, dense


def load_quantized_model(folder: str | Path) -> tuple[nn.Module, ModelConfig]:
    """The whole model of quantized folder ``folder`` on the CPU: dense parameters as stored, quantized linears as
    ``QuantizedLinear`` (``mmtrain.inference.loading`` prepares it for decoding, then ``use_quantized_kernels``).
    Raises ``QuantizedFolderError`` (a ``ConvertError``) naming the file or key for anything the folder does not
    hold as it should."""
    folder = Path(folder)
    cfg, _ = quantized_folder_config(folder)
    check_quantizable(cfg)
    spec = spec_of_config(read_hf_config(folder), str(folder / "config.json"))
    try:
        stored, dense = _grouped(read_hf_tensors(folder), spec)
        values = {name: linear_values(parts, spec, name) for name, parts in stored.items()}
        for name, (v, _) in values.items():  # the adapter maps and checks shapes; these stand for the weights
            dense[name + ".weight"] = torch.empty(v.shape, device="meta")
        adapter = model_family(cfg).hf
        ours = adapter.state_from_hf(dense, cfg)
    except (HFFolderError, *hf_errors()) as exc:
        raise QuantizedFolderError(str(exc)) from None
    with torch.device("cpu"):
        model = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True)
    linears = quantizable_linears(model)
    template = {k: v.to("meta") for k, v in model.state_dict().items()}
    rows = hf_linear_rows(adapter.state_to_hf, cfg, template, {k + ".weight": m.out_features
                                                               for k, m in linears.items()})
    extra, missing = sorted(set(values) - set(rows)), sorted(set(rows) - set(values))
    if extra:
        raise QuantizedFolderError(f"{folder}: {extra[0]} is quantized in the folder but is not a linear of the "
                                   "model's blocks (weights and config disagree)")
    if missing:
        raise QuantizedFolderError(f"{folder}: the model's linear {missing[0]} is not quantized in the folder "
                                   "(weights and config disagree)")
    _swap_in(model, linears, rows, values, ours, spec)
    dense_ours = {k: v for k, v in ours.items() if v.device.type != "meta"}
    result = model.load_state_dict(dense_ours, strict=False)
    quantized_keys = {f"{n}.{b}" for n in linears for b in ("weight", "weight_scale", "bias")}
    left = [k for k in result.missing_keys if k not in quantized_keys]
    if left or result.unexpected_keys:
        raise QuantizedFolderError(f"{folder}: the folder's weights do not fill the model "
                                   f"(missing {left[:3]}, unexpected {result.unexpected_keys[:3]})")
    check_decodable(model)
    return model, cfg


def use_quantized_kernels(model: nn.Module) -> int:
    """Once the model is on its device: each ``QuantizedLinear``'s CUDA kernel prepared where it applies (int4
    weights repacked for tinygemm); returns how many were."""
    return sum(m.use_cuda_kernel() for m in model.modules() if isinstance(m, QuantizedLinear))


def _swap_in(model: nn.Module, linears: dict[str, nn.Linear], rows: dict[str, tuple[str, torch.Tensor]],
             values: dict[str, tuple[torch.Tensor, torch.Tensor]], ours: dict[str, torch.Tensor],
             spec: QuantSpec) -> None:
    """Each of ``linears`` (our module name -> linear) replaced by a ``QuantizedLinear`` of the HF rows that make
    it (``rows``: HF linear -> (our weight key, row indices))."""
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for hf_name, (key, idx) in rows.items():
        parts.setdefault(key.removesuffix(".weight"), []).append((idx, *values[hf_name]))
    for name, linear in linears.items():
        pieces = parts[name]
        first_v, first_s = pieces[0][1], pieces[0][2]
        v = torch.empty((linear.out_features, first_v.shape[1]), dtype=first_v.dtype)
        s = torch.empty((linear.out_features, first_s.shape[1]), dtype=first_s.dtype)
        for idx, pv, ps in pieces:
            if pv.shape[1] != v.shape[1] or ps.shape[1] != s.shape[1] or ps.dtype != s.dtype:
                raise QuantizedFolderError(f"{name}: its HF parts have different widths or scale dtypes")
            v[idx], s[idx] = pv, ps
        if v.shape[1] != linear.in_features:
            raise QuantizedFolderError(f"{name}: {v.shape[1]} inputs in the folder, {linear.in_features} in the model")
        bias = ours.get(name + ".bias")
        quantized = QuantizedLinear.from_values(spec.scheme, v, s, bias, spec.group_size)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)
