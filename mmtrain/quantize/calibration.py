"""Calibration for GPTQ: samples of prepared data through the trainer's own sample builder, and the input Hessians
of each block's linears collected block by block, with the blocks before already quantized (what the quantized
model will feed the block), the forward stopped after the block being measured."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from mmtrain.model.quantized_linear import quantizable_linears


class _StopAfterBlock(Exception):
    """Raised by a hook once the block being calibrated has run: the layers after it are not needed."""


def calibration_batches(ckpt: str | Path, calib: str, samples: int, seq_len: int, batch_size: int,
                        seed: int) -> list[torch.Tensor]:
    """``samples`` token rows of ``seq_len`` from the train split of prepared dataset ``calib`` (an indexed prefix
    or a blend spec; the checkpoint's ``data.split``, so an evaluation of its valid split scores other documents),
    in the trainer's sample builder's shuffled order for ``seed``, as batches of ``batch_size`` rows. Data of
    another tokenizer than the checkpoint's is a ``ConfigError``."""
    from mmtrain.data.blend import build_gpt_samples_from_config
    from mmtrain.evaluate import check_data_tokenizer, eval_run_config

    cfg = eval_run_config(ckpt, calib, seq_length=seq_len, batch_size=batch_size, device="cpu")
    cfg.data.seed = seed
    check_data_tokenizer(cfg, ckpt, calib)
    found = build_gpt_samples_from_config(cfg, "train", 1, num_samples=samples)
    rows = [torch.as_tensor(found[i][:seq_len], dtype=torch.int64) for i in range(samples)]
    return [torch.stack(rows[i:i + batch_size]) for i in range(0, samples, batch_size)]


def block_hessians(model: nn.Module, index: str, batches: list[torch.Tensor],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The input Hessian ``2/n sum x x^T`` (fp32, on ``device``) of every quantizable linear of block ``index``
    over the calibration ``batches`` (the model's forward, stopped after that block)."""
    names = {n: m for n, m in quantizable_linears(model).items() if n.startswith(f"layers.{index}.")}
    sums = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float32, device=device)
            for n, m in names.items()}
    counts = dict.fromkeys(names, 0)

    def collect(name: str) -> Callable:
        def hook(module, args) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name].addmm_(x.t(), x)
            counts[name] += x.shape[0]
        return hook

    def stop(module, args, output) -> None:
        raise _StopAfterBlock

    handles = [m.register_forward_pre_hook(collect(n)) for n, m in names.items()]
    handles.append(model.layers[index].register_forward_hook(stop))
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(batch.to(device))
                except _StopAfterBlock:
                    pass
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] * (2.0 / max(counts[n], 1)) for n in names}


def blocks_in_order(model: nn.Module) -> Iterator[str]:
    """The block indices of the model's stage, in the order the forward runs them."""
    yield from model.layers.keys()
