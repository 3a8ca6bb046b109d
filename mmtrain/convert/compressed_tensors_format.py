"""The two quantization schemes mmtrain writes and runs, in the ``compressed-tensors`` format that transformers and
vLLM load (``config.json``'s ``quantization_config``, per-linear tensors), built with the ``compressed-tensors``
library itself: its preset schemes, its config class and its compressors (quantize, pack).

- ``fp8``: compressed-tensors' ``FP8_DYNAMIC`` preset, format ``float-quantized``: weights FP8 E4M3 with one scale
  per output channel (``weight`` float8 (out, in), ``weight_scale`` (out, 1)); input activations FP8 with a scale
  per token computed at run time (nothing calibrated, nothing stored).
- ``w4a16``: the ``W4A16`` preset, format ``pack-quantized``: weights 4-bit integers, symmetric (no zero point),
  one scale per group of ``group_size`` inputs of a row (``weight_packed`` int32 (out, in/8), ``weight_scale``
  (out, in/group), ``weight_shape``); activations stay in the model's dtype.

Every ``Linear`` is quantized but the output layer (``ignore: [lm_head]``); embeddings and norms stay dense. A
folder whose ``quantization_config`` says anything else is a one-line ``QuantizedFolderError`` naming the key."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmtrain.convert.checkpoint_io import ConvertError

SCHEMES = ("fp8", "w4a16")
PRESETS = {"fp8": "FP8_DYNAMIC", "w4a16": "W4A16"}  # compressed-tensors' preset of each scheme
FORMATS = {"fp8": "float-quantized", "w4a16": "pack-quantized"}
IGNORED = ["lm_head"]
GROUP_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)  # the preset's is 128; tinygemm (CUDA) takes 32-256
# what a quantized linear stores beside its HF module name, by scheme
STORED_SUFFIXES = {"fp8": ("weight", "weight_scale"), "w4a16": ("weight_packed", "weight_scale", "weight_shape")}


class QuantizedFolderError(ConvertError):
    """A quantized HF folder (or a request to write one) mmtrain does not handle; the message names the key (a
    ``ConvertError``: the entry points that read checkpoints print it as one line)."""


@dataclass(frozen=True)
class QuantSpec:
    """A scheme and its group size (``w4a16``; 0 for ``fp8``, whose weight scales are per output channel)."""

    scheme: str
    group_size: int = 0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise QuantizedFolderError(f"--scheme {self.scheme}: choose one of {', '.join(SCHEMES)}")
        if self.scheme == "w4a16" and self.group_size not in GROUP_SIZES:
            raise QuantizedFolderError(f"--group-size {self.group_size}: choose one of "
                                       f"{', '.join(map(str, GROUP_SIZES))} (128 is compressed-tensors' W4A16; "
                                       "the CUDA int4 kernel takes 32 to 256)")

    @property
    def format(self) -> str:
        return FORMATS[self.scheme]

    def library_scheme(self):
        """The ``compressed_tensors`` ``QuantizationScheme`` (the preset, targets ``Linear``, our group size)."""
        from compressed_tensors.quantization import preset_name_to_scheme

        scheme = preset_name_to_scheme(PRESETS[self.scheme], ["Linear"])
        if self.scheme == "w4a16":
            scheme.weights.group_size = self.group_size
        return scheme

    def qmax(self) -> float:
        """The largest magnitude a quantized weight takes (448 for FP8 E4M3, 7 for int4: [-8, 7])."""
        return torch.finfo(torch.float8_e4m3fn).max if self.scheme == "fp8" else 7.0


def weight_scales(weight: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype) -> torch.Tensor:
    """The scales of ``weight`` (out, in) as compressed-tensors computes them (``calculate_qparams``: per output
    channel for FP8, per row and group for int4, symmetric), rounded to ``scale_dtype`` (what the folder stores)
    so that quantizing with them and dequantizing from the folder use the same numbers."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.float()
    if spec.scheme == "w4a16":
        w = w.unflatten(-1, (w.shape[-1] // spec.group_size, spec.group_size))
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale, _ = calculate_qparams(low, high, spec.library_scheme().weights)
    return scale.reshape(weight.shape[0], -1).to(scale_dtype)


def quantize_values(weight: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The quantized values of ``weight`` with ``scale`` (compressed-tensors' ``quantize``): int8 in [-8, 7] for
    int4, float8 E4M3 for FP8; (out, in)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    dtype = torch.int8 if spec.scheme == "w4a16" else torch.float8_e4m3fn
    return quantize(weight.float(), scale.float(), None, spec.library_scheme().weights, dtype=dtype)


def dequantize_values(values: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``values`` (out, in) times their scales, in the scales' dtype (what a dense load of the folder holds)."""
    if spec.scheme == "w4a16":
        return (values.to(scale.dtype).unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2)
    return values.to(scale.dtype) * scale


def compressed_linear(values: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """One linear's stored tensors (suffix -> tensor, ``STORED_SUFFIXES``) from its quantized values and scales,
    through the format's compressor (it quantizes the dequantized weight again with the same scales, which gives
    back the same values exactly, and packs int4 eight to an int32)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.load_from_registry(spec.format)
    dense = dequantize_values(values, scale.float(), spec)
    out = compressor.compress({"weight": dense, "weight_scale": scale.float()}, spec.library_scheme())
    out["weight_scale"] = scale  # stored in the dtype the values were made with
    return {k: v for k, v in out.items() if k in STORED_SUFFIXES[spec.scheme]}


def quantization_config(spec: QuantSpec) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``spec``, as compressed-tensors writes it (its
    ``ModelCompressor.update_config`` on a scratch folder: version, quant_method, config_groups, format, ignore,
    status ``compressed``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig(config_groups={"group_0": spec.library_scheme()}, format=spec.format,
                                ignore=list(IGNORED), quantization_status=QuantizationStatus.COMPRESSED)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text("{}")
        ModelCompressor(quantization_config=config).update_config(scratch)
        return json.loads((Path(scratch) / "config.json").read_text())["quantization_config"]


def spec_of_config(hf_config: dict[str, Any], where: str) -> QuantSpec:
    """The ``QuantSpec`` a folder's ``config.json`` (at ``where``) declares; a ``quantization_config`` that is not
    exactly one of ours (other method, format, scheme arguments, targets or ignore list) is a one-line error."""
    q = hf_config.get("quantization_config")
    if not isinstance(q, dict):
        raise QuantizedFolderError(f"{where}: no quantization_config (not a quantized folder)")
    if q.get("quant_method") != "compressed-tensors":
        raise QuantizedFolderError(f"{where}: quantization_config.quant_method={q.get('quant_method')!r}; mmtrain "
                                   "runs 'compressed-tensors' folders")
    scheme = {v: k for k, v in FORMATS.items()}.get(q.get("format"))
    groups = q.get("config_groups")
    if scheme is None:
        raise QuantizedFolderError(f"{where}: quantization_config.format={q.get('format')!r}; mmtrain runs "
                                   f"{' and '.join(repr(f) for f in FORMATS.values())}")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise QuantizedFolderError(f"{where}: quantization_config.config_groups must hold one group (found "
                                   f"{len(groups) if isinstance(groups, dict) else groups!r})")
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise QuantizedFolderError(f"{where}: quantization_config.config_groups.{name} is not a mapping")
    weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
    size = weights.get("group_size") if scheme == "w4a16" else 0
    if scheme == "w4a16" and (isinstance(size, bool) or size not in GROUP_SIZES):
        raise QuantizedFolderError(f"{where}: quantization_config.config_groups.{name}.weights.group_size={size!r}; "
                                   f"mmtrain runs groups of {', '.join(map(str, GROUP_SIZES))}")
    spec = QuantSpec(scheme, size)
    expected = spec.library_scheme().model_dump()
    for part in ("weights", "input_activations", "output_activations"):
        found, want = group.get(part), expected.get(part)
        keys = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")
        if (found is None) != (want is None) or (want and any(found.get(k) != want.get(k) for k in keys)):
            raise QuantizedFolderError(f"{where}: quantization_config.config_groups.{name}.{part}={found!r} is not "
                                       f"compressed-tensors' {PRESETS[scheme]} scheme (what mmtrain runs)")
    if group.get("targets") != ["Linear"] or list(q.get("ignore") or []) != IGNORED:
        raise QuantizedFolderError(f"{where}: quantization_config targets {group.get('targets')!r} ignoring "
                                   f"{q.get('ignore')!r}; mmtrain runs every Linear but lm_head quantized")
    return spec


def linear_values(stored: dict[str, torch.Tensor], spec: QuantSpec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (out, in): int8 or float8, scales) of HF linear ``name`` from its stored tensors (suffix ->
    tensor); shapes that disagree are a one-line error naming the tensor."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    missing = [s for s in STORED_SUFFIXES[spec.scheme] if s not in stored]
    if missing:
        raise QuantizedFolderError(f"{name}: no {name}.{missing[0]} (a {spec.format} linear stores "
                                   f"{', '.join(STORED_SUFFIXES[spec.scheme])})")
    scale = stored["weight_scale"]
    if spec.scheme == "fp8":
        values = stored["weight"]
        if values.dtype != torch.float8_e4m3fn or values.ndim != 2 or tuple(scale.shape) != (values.shape[0], 1):
            raise QuantizedFolderError(f"{name}.weight {values.dtype} {tuple(values.shape)} with weight_scale "
                                       f"{tuple(scale.shape)}: not FP8 E4M3 (out, in) with (out, 1) scales")
        return values, scale
    packed, shape = stored["weight_packed"], stored["weight_shape"].tolist()
    if (len(shape) != 2 or packed.dtype != torch.int32 or shape[1] % spec.group_size
            or tuple(packed.shape) != (shape[0], shape[1] // 8)
            or tuple(scale.shape) != (shape[0], shape[1] // spec.group_size)):
        raise QuantizedFolderError(f"{name}: weight_packed {packed.dtype} {tuple(packed.shape)}, weight_scale "
                                   f"{tuple(scale.shape)} and weight_shape {shape} do not fit int4 groups of "
                                   f"{spec.group_size}")
    return unpack_from_int32(packed, 4, torch.Size(shape)), scale


def check_quantizable(cfg: Any) -> None:
    """Refuse, in one line naming the family, a model whose family does not declare ``supports_quantization``
    (its linears map row by row to its HF export, tested) or that has routed experts (not quantized yet)."""
    from mmtrain.config.family_sections import families_with
    from mmtrain.models.registry import model_family

    if not cfg.shape().supports_quantization:
        raise QuantizedFolderError(f"model.family={cfg.family}: post-training quantization supports model.family="
                                   f"{' or '.join(families_with('supports_quantization'))}")
    if model_family(cfg).has_routed_experts(cfg):
        raise QuantizedFolderError(f"model.family={cfg.family} with routed experts (model.num_experts): MoE models "
                                   "are not quantized yet; quantize a dense model")
