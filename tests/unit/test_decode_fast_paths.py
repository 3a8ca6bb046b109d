"""The decode step's fast paths equal what they replace: the two-pass argmax (first index of the largest value,
ties included) and the swap of linears and SwiGLU MLPs for the decode kernel's (what it swaps, and that nothing
changes on the CPU; the kernel in tests/unit/test_gemv.py, the CUDA path in tests/gpu/test_generate_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmtrain.inference.decode_linears import GemvLinear, GemvMLP, use_decode_kernels
from mmtrain.inference.sampling import argmax_rows
from mmtrain.model.mlp import MLP
from mmtrain.model.quantized_linear import QuantizedLinear


@pytest.mark.parametrize("vocab", [7, 2048, 3000, 128256])
def test_two_pass_argmax_is_argmax_with_ties_infinities_and_nans(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (5, vocab), generator=g).float()  # many exact ties
    logits[1] = float("-inf")
    logits[1, vocab - 1] = 0.0  # the only finite entry is the last one (in the padded chunk)
    logits[2, vocab // 2:] = float("inf")
    logits[3, [vocab // 3, vocab - 1]] = float("nan")  # a broken model's NaNs win, the first one as in argmax
    for x in (logits, logits.bfloat16()):
        assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_the_swap_keeps_the_model_and_its_cpu_calls():
    """``use_decode_kernels`` swaps plain linears and SwiGLU MLPs of plain linears, and nothing else; the state
    dict is untouched and CPU calls stay the modules' own."""
    from mmtrain.config.schema import ModelConfig

    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(hidden_size=64, ffn_hidden_size=96, activation="swiglu")
    gelu = ModelConfig(hidden_size=64, ffn_hidden_size=96, activation="gelu")
    model = nn.Sequential(MLP(cfg), nn.Linear(64, 64), MLP(gelu), nn.LayerNorm(64))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    model[0].down = QuantizedLinear.from_values("fp8", torch.zeros(64, 96, dtype=torch.float8_e4m3fn),
                                                torch.ones(64, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 64, generator=g)
    ref = model(x)
    assert use_decode_kernels(model) == 5  # the SwiGLU MLP, its up, the linear, the GELU MLP's two linears
    assert [type(m) for m in model] == [GemvMLP, GemvLinear, MLP, nn.LayerNorm]
    assert type(model[0].up) is GemvLinear and type(model[0].down) is QuantizedLinear
    assert type(model[2].up) is GemvLinear and type(model[2].down) is GemvLinear
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(model(x), ref)  # on the CPU the calls stay nn.Linear's and MLP's
    assert use_decode_kernels(model) == 0  # twice is once
