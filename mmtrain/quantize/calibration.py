"""Calibration for GPTQ: samples of prepared data through the trainer's own sample builder, and the input Hessians
of each block's linears collected block by block, with the blocks before already quantized (what the quantized
model will feed the block), the forward stopped after the block being measured."""

from __future__ import annotations

from collections.abc import Callable
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


def _hessians_of(model: nn.Module, index: str, run: Callable[[], None],
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The input Hessian ``2/n sum x x^T`` (fp32, on ``device``) of every quantizable linear of block ``index`` over
    what ``run()`` feeds them."""
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

    handles = [m.register_forward_pre_hook(collect(n)) for n, m in names.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] * (2.0 / max(counts[n], 1)) for n in names}


def block_hessians(model: nn.Module, index: str, batches: list[torch.Tensor],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """``_hessians_of`` block ``index`` over the calibration ``batches``: the model's whole forward, stopped after
    that block (any model; ``BlockChain`` runs the block alone where the blocks form a chain)."""
    return _hessians_of(model, index, lambda: _forward_through(model, index, batches, device), device)


def _forward_through(model: nn.Module, index: str, batches: list[torch.Tensor], device: torch.device) -> None:
    """The model's forward of each batch, stopped after block ``index`` (what comes after it is not needed)."""
    def stop(module, args, output) -> None:
        raise _StopAfterBlock

    handle = model.layers[index].register_forward_hook(stop)
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(batch.to(device))
                except _StopAfterBlock:
                    pass
    finally:
        handle.remove()


class BlockChain:
    """The calibration batches carried through the blocks one block at a time: one forward of the model records
    each block's call (its input for the first block; its other arguments for every block), after which a block
    runs alone on the previous block's outputs. ``capture`` returns None where the blocks are not a plain chain
    (a block's input is not the previous block's output object): then ``block_hessians`` (a forward from the
    start per block) is the way."""

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], calls: dict[str, list[tuple]]) -> None:
        self.model, self.inputs, self.calls = model, inputs, calls

    @classmethod
    def capture(cls, model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> BlockChain | None:
        order = list(model.layers.keys())
        calls: dict[str, list[tuple]] = {i: [] for i in order}
        inputs: list[torch.Tensor] = []
        state = {"chain": True, "last": None}

        def before(index: str) -> Callable:
            def hook(module, args, kwargs) -> None:
                if index == order[0]:
                    inputs.append(args[0])
                elif args[0] is not state["last"]:
                    state["chain"] = False
                calls[index].append((args[1:], kwargs))  # references: shared rotary tables, masks
            return hook

        def after(module, args, kwargs, output) -> None:
            state["last"] = output

        handles = [model.layers[i].register_forward_pre_hook(before(i), with_kwargs=True) for i in order]
        handles += [model.layers[i].register_forward_hook(after, with_kwargs=True) for i in order]
        try:
            _forward_through(model, order[-1], batches, device)
        finally:
            for h in handles:
                h.remove()
        if not state["chain"] or not all(isinstance(x, torch.Tensor) for x in inputs):
            return None
        return cls(model, inputs, calls)

    def _outputs(self, index: str) -> list[torch.Tensor]:
        block = self.model.layers[index]
        return [block(x, *args, **kwargs) for x, (args, kwargs) in zip(self.inputs, self.calls[index])]

    def hessians(self, index: str, device: torch.device) -> dict[str, torch.Tensor]:
        """``_hessians_of`` block ``index`` on the current inputs (the block alone)."""
        return _hessians_of(self.model, index, lambda: self._outputs(index), device)

    @torch.no_grad()
    def advance(self, index: str) -> None:
        """The inputs of the block after ``index``: its outputs with its current (quantized) weights."""
        self.inputs = self._outputs(index)
        self.calls[index] = []
