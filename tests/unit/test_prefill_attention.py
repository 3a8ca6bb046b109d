"""A prefill from position 0 attends causally without a mask (``kv_cache.from_start_attention``): the same
result as the masked cached attention, for grouped heads, a window wider than the prompt and a scale; every
other call keeps the mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmtrain.model import kv_cache
from mmtrain.model.kv_cache import cached_attention

FROM_START = kv_cache.from_start_attention


def _masked(q_BSHD, keys, values, positions_BS, scale=None, window=None):
    """The mask route, written out: key t visible to the query at p iff t <= p (and p - t < window)."""
    T = keys.shape[2]
    distance = positions_BS[:, None, :, None] - torch.arange(T)[None, None, None, :]
    visible = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    q = q_BSHD.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,window,scale", [(4, 4, None, None), (8, 2, None, 0.3), (4, 2, 64, None)])
def test_a_prefill_from_the_start_equals_the_masked_attention(monkeypatch, heads, kv_heads, window, scale):
    g = torch.Generator().manual_seed(0)
    B, S, D = 3, 11, 16
    q = torch.randn(B, S, heads, D, generator=g)
    keys, values = torch.randn(2, B, kv_heads, S, D, generator=g)
    positions = torch.arange(S).expand(B, S)
    calls = []
    monkeypatch.setattr(kv_cache, "from_start_attention", lambda *a, **k: calls.append(1) or FROM_START(*a, **k))
    out = cached_attention(q, keys, values, torch.arange(S), positions, scale=scale, window=window)
    assert calls == [1]
    torch.testing.assert_close(out, _masked(q, keys, values, positions, scale, window), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("S,T,window", [(1, 9, None), (4, 9, None), (9, 9, 4)])
def test_other_calls_keep_the_mask(monkeypatch, S, T, window):
    """A decode step (fewer queries than keys) and a window narrower than the prompt do not take the causal route."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, S, 4, 8, generator=g)
    keys, values = torch.randn(2, 2, 2, T, 8, generator=g)
    positions = (torch.arange(S) + T - S).expand(2, S)
    monkeypatch.setattr(kv_cache, "from_start_attention", lambda *a, **k: pytest.fail("took the causal route"))
    out = cached_attention(q, keys, values, torch.arange(T), positions, window=window)
    torch.testing.assert_close(out, _masked(q, keys, values, positions, window=window), rtol=1e-5, atol=1e-6)
