"""A checkpoint and its tokenizer, ready to decode: the model built whole (or this rank's tensor-parallel shard of
it), its weights read from any training layout or a weights-only checkpoint, moved to the device, parameters in
the compute dtype (buffers such as the RoPE frequencies keep theirs). A LoRA run's checkpoint (its complete.json
records ``peft.lora``) is built with its adapters, they are read with the base weights and merged into them
(``mmtrain.model.lora.merge_adapters``): what is decoded is the adapted model, at the base model's cost. A quantized
Hugging Face folder of ``python -m mmtrain.quantize`` loads too, in one process (``mmtrain.inference.
quantized_loading``): its quantized linears stay quantized, their buffers keep their dtypes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmtrain.convert.checkpoint_io import checkpoint_lora, load_model_weights, read_checkpoint_config
from mmtrain.config.schema import ModelConfig
from mmtrain.inference.decoder import UnsupportedModelError, check_decodable
from mmtrain.inference.decode_linears import use_decode_kernels
from mmtrain.inference.quantized_loading import (
    is_quantized_folder,
    load_quantized_model,
    quantized_folder_config,
    use_quantized_kernels,
)
from mmtrain.model.lora import merge_adapters
from mmtrain.models.registry import model_family
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.tensor import apply_tensor_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_for_decoding(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``model`` on ``device`` in eval mode with its parameters in ``dtype`` (buffers keep their dtype: the RoPE
    inverse frequencies stay fp32, as in training), its linears and SwiGLU MLPs sending few-token calls to the
    decode kernel (``mmtrain.inference.decode_linears``: a model prepared here is only decoded)."""
    model.to(device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
        p.requires_grad_(False)
    use_decode_kernels(model)
    return model.eval()


def checkpoint_config(ckpt: str | Path) -> tuple[ModelConfig, dict]:
    """(model config, complete.json) of checkpoint ``ckpt``; of a quantized folder, its model config and the
    record ``mmtrain.quantize`` kept of its source (the tokenizer, the run's data settings)."""
    return quantized_folder_config(ckpt) if is_quantized_folder(ckpt) else read_checkpoint_config(ckpt)


def load_checkpoint_model(ckpt: str | Path, mesh: ParallelMesh, device: torch.device | str,
                          dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> tuple[nn.Module, ModelConfig]:
    """This rank's decodable model from checkpoint ``ckpt`` (weights only; any layout that wrote it; or a quantized
    HF folder of ``mmtrain.quantize``, in one process: ``mmtrain.inference.quantized_loading``): the whole
    model of its family (every registered family decodes: the contract's ``decode``), sharded over ``mesh``'s TP
    group (MoE experts whole on every rank); a LoRA run's adapters merged in. Raises ``ConvertError`` for an
    unreadable checkpoint, ``UnsupportedModelError`` for a layout generation does not run."""
    if is_quantized_folder(ckpt):  # python -m mmtrain.quantize's output (docs/quantization.md)
        if mesh.dims.world_size > 1:
            raise UnsupportedModelError(f"{ckpt}: a quantized folder decodes in one process (got "
                                        f"{mesh.dims.describe()}); start it without torchrun")
        model, cfg = load_quantized_model(ckpt)
        model = prepare_for_decoding(model, device, dtype)
        use_quantized_kernels(model)
        return model, cfg
    cfg, meta = read_checkpoint_config(ckpt)
    if mesh.dims.pp > 1 or mesh.dims.cp > 1 or mesh.dims.ep > 1:
        raise UnsupportedModelError("generation runs tensor-parallel only: start it with as many ranks as the "
                                    f"TP size (got {mesh.dims.describe()})")
    lora = checkpoint_lora(meta, ckpt)
    shape = cfg.shape()
    with torch.device("cpu"):
        model = model_family(cfg).build_stage(cfg, (0, shape.num_layers), True, True, lora=lora)
    apply_tensor_parallel(model, mesh.tp_group)
    load_model_weights(ckpt, mesh, model, verify=verify, adapters=lora is not None)
    merge_adapters(model)
    check_decodable(model)
    return prepare_for_decoding(model, device, dtype), cfg
