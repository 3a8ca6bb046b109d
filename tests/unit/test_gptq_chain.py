"""GPTQ's calibration through the block chain (each block run alone on the previous block's outputs, one forward
of the model to record the calls) gives the same quantized weights as a forward from the start per block; a model
whose blocks are not a plain chain falls back to the latter."""

from __future__ import annotations

import torch

from mmtrain.convert.compressed_tensors_format import QuantSpec
from mmtrain.quantize import run as quantize_run
from mmtrain.quantize.calibration import BlockChain
from tests.inference_helpers import tiny_model


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (2, 32), generator=g) for _ in range(3)]


def _quantized(monkeypatch, chain: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    model = tiny_model().float()
    if not chain:
        monkeypatch.setattr(quantize_run.BlockChain, "capture", classmethod(lambda cls, *a: None))
    lines: list[str] = []
    out = quantize_run._gptq(model, _batches(), QuantSpec("w4a16", 32), torch.float32, torch.device("cpu"),
                             lines.append)
    monkeypatch.undo()
    assert len(lines) == len(model.layers)
    return out


def test_the_chain_quantizes_as_the_forward_from_the_start_per_block(monkeypatch):
    chained, per_block = _quantized(monkeypatch, True), _quantized(monkeypatch, False)
    assert chained.keys() == per_block.keys() and len(chained) >= 8
    for name in chained:
        for got, want in zip(chained[name], per_block[name]):
            assert torch.equal(got, want), name


def test_blocks_that_are_not_a_plain_chain_are_not_run_alone():
    """A block whose input is not the previous block's output object (here: a new tensor made before it):
    recording the calls finds it."""
    model = tiny_model().float()
    second = list(model.layers.values())[1]
    second.register_forward_pre_hook(lambda module, args: (args[0] * 1.0, *args[1:]))
    assert BlockChain.capture(model, _batches(), torch.device("cpu")) is None
    assert BlockChain.capture(tiny_model().float(), _batches(), torch.device("cpu")) is not None
