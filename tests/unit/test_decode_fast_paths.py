"""The decode step's fast paths equal what they replace: the two-pass argmax (first index of the largest value,
ties included) and the split-K linear of few-token calls (its math on the CPU; the CUDA path in
tests/gpu/test_generate_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmtrain.inference.sampling import argmax_rows
from mmtrain.inference.split_k import SplitKLinear, split_count, split_k_matmul, use_split_k


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


def test_split_counts():
    assert split_count(8192, 2048) == 8  # Llama-3.2-1B's down projection
    assert split_count(10944, 2048) == 8  # DeepSeek-V2-Lite's dense MLP: slices of 1368
    assert split_count(6000, 1000) == 2  # 4 slices of 1500 are not 16-byte rows
    assert split_count(2048, 3072) == split_count(4096, 4096) == split_count(1024, 128) == 1
    assert split_count(2048, 576) == 1  # DeepSeek-V2-Lite's kv_down: narrower than anything measured


def test_split_k_matmul_and_the_swap_keep_the_linear():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 8192, generator=g), torch.randn(3, 8192, generator=g)
    torch.testing.assert_close(split_k_matmul(x, w, 8), x @ w.T, rtol=1e-4, atol=1e-4)
    model = nn.Sequential(nn.Linear(8192, 64), nn.Linear(64, 8192), nn.Linear(8192, 2048, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(x)
    assert use_split_k(model) == 2
    assert [type(m) for m in model] == [SplitKLinear, nn.Linear, SplitKLinear] and model[0].splits == 8
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(model(x), ref)  # on the CPU the calls stay nn.Linear's
