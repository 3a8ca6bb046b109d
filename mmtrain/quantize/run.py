"""``quantize_checkpoint``: an mmtrain checkpoint -> a quantized Hugging Face folder (compressed-tensors FP8 or
W4A16), end to end: the checkpoint's tokenizer (refused early when it names none), its full weights (a LoRA run's
adapters merged, as the HF export merges them), the model built whole on one device, every linear of its blocks
quantized (round-to-nearest, or GPTQ on calibration samples block after block), the folder written
(``mmtrain.quantize.export``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmtrain.convert.checkpoint_io import ConvertError, checkpoint_lora, read_full_state
from mmtrain.convert.compressed_tensors_format import (
    QuantizedFolderError,
    QuantSpec,
    check_quantizable,
    dequantize_values,
)
from mmtrain.convert.convert import export_tokenizer
from mmtrain.model.quantized_linear import quantizable_linears
from mmtrain.models.registry import model_family
from mmtrain.quantize.calibration import BlockChain, block_hessians, calibration_batches
from mmtrain.quantize.export import check_output_folder, quantized_hf_tensors, write_quantized_folder
from mmtrain.quantize.gptq import quantize_gptq, quantize_rtn

METHODS = ("rtn", "gptq")


@dataclass
class QuantizeSettings:
    """What ``python -m mmtrain.quantize`` takes (its --help says each)."""

    scheme: str
    method: str = "rtn"
    calib: str | None = None
    samples: int = 256
    seq_len: int = 2048
    batch_size: int = 8
    group_size: int = 128
    dtype: torch.dtype | None = None
    seed: int = 1234
    tokenizer: str | None = None

    def spec(self) -> QuantSpec:
        """The scheme as written (one line for an unknown scheme, method or group size)."""
        spec = QuantSpec(self.scheme, self.group_size if self.scheme == "w4a16" else 0)
        if self.method not in METHODS:
            raise QuantizedFolderError(f"--method {self.method}: choose one of {', '.join(METHODS)}")
        if self.scheme == "fp8" and self.method != "rtn":
            raise QuantizedFolderError(f"--method {self.method} is for --scheme w4a16; FP8 weights are rounded per "
                                       "channel (--method rtn) and activations scaled per token at run time")
        if self.method == "gptq" and not self.calib:
            raise QuantizedFolderError("--method gptq needs --calib PREFIX (prepared data: mmtrain-prep text)")
        return spec


def quantize_checkpoint(ckpt: str | Path, out: str | Path, settings: QuantizeSettings,
                        device: torch.device | str = "cpu", log: Callable[[str], None] = print) -> Path:
    """Quantize checkpoint ``ckpt`` into HF folder ``out`` (module docstring); ``log`` gets a line per stage."""
    spec = settings.spec()
    check_output_folder(out)
    tok, tokenizer_files = export_tokenizer(ckpt, settings.tokenizer)
    if tok is None:
        raise ConvertError(f"{ckpt} names no tokenizer (its data had no manifest, or it was converted without "
                           "one): pass --tokenizer, the tokenizer the model was trained with")
    full, cfg, meta = read_full_state(ckpt)
    check_quantizable(cfg)
    lora = checkpoint_lora(meta, ckpt)
    if lora is not None:
        full = model_family(cfg).hf.merge_lora(full, cfg, lora)
    model = _dense_model(full, cfg, device)
    linears = quantizable_linears(model)
    for name, linear in linears.items():
        if spec.scheme == "w4a16" and linear.in_features % spec.group_size:
            raise QuantizedFolderError(f"{name}: {linear.in_features} inputs is not a multiple of --group-size "
                                       f"{spec.group_size}; pick a group size that divides it")
    scale_dtype = settings.dtype or next(iter(linears.values())).weight.dtype
    started = time.perf_counter()
    if settings.method == "gptq":
        batches = calibration_batches(ckpt, settings.calib, settings.samples, settings.seq_len,
                                      settings.batch_size, settings.seed)
        log(f"calibration: {settings.samples} samples of {settings.seq_len} tokens from {settings.calib}")
        quantized = _gptq(model, batches, spec, scale_dtype, torch.device(device), log)
    else:
        quantized = {n: quantize_rtn(m.weight.data, spec, scale_dtype) for n, m in linears.items()}
    log(f"quantized {len(quantized)} linears ({spec.scheme}, {settings.method}) in "
        f"{time.perf_counter() - started:.1f} s")
    quantized = {n: (v.cpu(), s.cpu()) for n, (v, s) in quantized.items()}
    tensors = quantized_hf_tensors(full, cfg, quantized, spec, settings.dtype)
    run = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    provenance = {"source": str(ckpt), "config": {"data": run.get("data") or {}}, "scheme": spec.scheme, "format": spec.format, "method": settings.method,
                  "group_size": spec.group_size or None, "tokenizer": tok.describe(),
                  "calibration": ({"data": str(settings.calib), "samples": settings.samples,
                                   "seq_len": settings.seq_len, "seed": settings.seed}
                                  if settings.method == "gptq" else None)}
    dense_dtype = settings.dtype or next(t.dtype for t in full.values() if t.is_floating_point())
    return write_quantized_folder(out, tensors, dense_dtype, cfg, meta, spec, tok, tokenizer_files, provenance)


def _dense_model(full: dict[str, torch.Tensor], cfg, device: torch.device | str) -> torch.nn.Module:
    """The whole model of ``cfg`` with the checkpoint's weights (fp32) on ``device``, in eval mode."""
    with torch.device("cpu"):
        model = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True)
    result = model.load_state_dict(full, strict=False)
    if result.missing_keys:
        raise ConvertError(f"the checkpoint lacks {result.missing_keys[0]} of the model it names")
    return model.float().to(device).eval()


def _gptq(model: torch.nn.Module, batches: list[torch.Tensor], spec: QuantSpec, scale_dtype: torch.dtype,
          device: torch.device, log: Callable[[str], None]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ block after block: each block's linears measured on what the (already quantized) blocks before it
    give, quantized, and their weights set to the dequantized values for the blocks after. Where the blocks form
    a chain, the batches go through each block once to measure and once to move on (``BlockChain``), not
    through every block before it again."""
    linears = quantizable_linears(model)
    chain = BlockChain.capture(model, batches, device)
    out = {}
    for index in model.layers.keys():
        hessians = chain.hessians(index, device) if chain else block_hessians(model, index, batches, device)
        for name, h in hessians.items():
            weight = linears[name].weight
            values, scale = quantize_gptq(weight.data, h, spec, scale_dtype)
            out[name] = (values, scale)
            weight.data = dequantize_values(values, scale, spec).to(weight.dtype)
        if chain:
            chain.advance(index)
        log(f"block {index}: {len(hessians)} linears quantized (GPTQ)")
    return out
