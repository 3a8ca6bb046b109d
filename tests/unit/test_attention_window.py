"""Sliding windows, attention sinks and softcap in the shared attention strategies (fp32, CPU), against a naive
reference written from the definitions (explicit scores, a mask built key by key, the sink as one more softmax
column): the flex block mask's structure and its dense form for random document layouts × windows (window 1,
windows that are no multiple of the block, window >= the sequence, query offsets), both kernels' outputs and
q/k/v gradients (flex's CPU backward refusal lifted as in test_document_attention.py), the strategy's calls
without documents, and the KV-cache decode core row by row against full attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from mmtrain.model.attention import (CausalAttention, DenseDocuments, FlexDocuments, LengthMask, dense_document_mask,
                                     document_block_mask)
from mmtrain.model.kv_cache import cached_attention

from tests.unit.test_document_attention import _assert_blocks_match, _docs_from_bounds


@pytest.fixture
def cpu_flex(monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: None)


def naive_mask(q_ids: list[int] | None, kv_ids: list[int] | None, Q: int, K: int, q_offset: int,
               window: int | None) -> torch.Tensor:
    """(Q, K) bool, key by key from the rule: j <= i + offset, same document, i + offset - j < window."""
    return torch.tensor([[j <= i + q_offset and (q_ids is None or q_ids[i] == kv_ids[j])
                          and (window is None or i + q_offset - j < window) for j in range(K)] for i in range(Q)])


def naive_attention(q, k, v, mask_BQK: torch.Tensor, scale=None, sinks_H=None, softcap=None) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask_BQK[:, None], float("-inf"))
    if sinks_H is not None:
        sink = sinks_H[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    return torch.softmax(scores, -1) @ v


def _qkv(B, H, KV, Q, K, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, requires_grad=True) for h, n in ((H, Q), (KV, K), (KV, K))]


def _out_and_grads(fn, tensors):
    out = fn(*tensors)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


def _assert_same(got, want, tol=(1e-5, 1e-6)):
    (got_out, got_grads), (want_out, want_grads) = got, want
    torch.testing.assert_close(got_out, want_out, rtol=tol[0], atol=tol[1])
    for name, g, w in zip("qkv sinks".split(), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1], msg=lambda m, n=name: f"d{n}: {m}")


def _random_layout(S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(0, 8, (1,), generator=g))
    return _docs_from_bounds(S, sorted(torch.randint(1, S, (count,), generator=g).tolist()))


WINDOWS = [1, 3, 8, 13, 20, 47, 48, 200]  # 8 = the block; 13, 20: no multiple of it; 48, 200 >= the sequence


CASES = [(8, 0, 48, 48), (8, 16, 48, 16), (16, 20, 44, 24)]  # (block, query offset, keys, queries)


def _layout_case(window, block, q_offset, S, Q, seed):
    ids = torch.stack([_random_layout(S, seed), _random_layout(S, 100 + seed)])
    return ids[:, q_offset:q_offset + Q], ids[:, :q_offset + Q]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block, q_offset, S, Q", CASES)
def test_window_block_mask_equals_dense_mask_and_naive_rule(window, block, q_offset, S, Q):
    for seed in range(4):
        q_ids, kv_ids = _layout_case(window, block, q_offset, S, Q, seed)
        dense = dense_document_mask(q_ids, kv_ids, q_offset, window)[:, 0]
        for b in range(2):
            want = naive_mask(q_ids[b].tolist(), kv_ids[b].tolist(), Q, q_offset + Q, q_offset, window)
            assert torch.equal(dense[b], want), (seed, b)
        _assert_blocks_match(document_block_mask(q_ids, kv_ids, q_offset, block, window), dense, block)


@pytest.mark.parametrize("window, case", [(1, 0), (13, 0), (200, 0), (20, 1), (3, 2), (13, 2)])
def test_window_flex_and_dense_outputs_and_grads_equal_the_naive_reference(cpu_flex, window, case):
    block, q_offset, S, Q = CASES[case]
    q_ids, kv_ids = _layout_case(window, block, q_offset, S, Q, seed=window)
    rule = dense_document_mask(q_ids, kv_ids, q_offset, window)[:, 0]
    tensors = _qkv(2, 4, 2, Q, q_offset + Q, 8, seed=window)
    want = _out_and_grads(lambda *t: naive_attention(*t, rule), tensors)
    for kernel in (FlexDocuments(block), DenseDocuments()):
        mask = kernel.mask(q_ids, kv_ids, q_offset, window)
        _assert_same(_out_and_grads(lambda *t: kernel.attend(*t, mask, None), tensors), want)


def test_window_block_mask_skips_blocks_outside_the_window():
    S, block, window = 64, 8, 12
    ids = torch.zeros(1, S, dtype=torch.long)
    mask = document_block_mask(ids, ids, 0, block, window)
    n = S // block
    partial, full = mask.kv_num_blocks[0, 0], mask.full_kv_num_blocks[0, 0]
    # query block r reaches back (window - 1) = 11 tokens: blocks r-2 (partly), r-1 (partly: 11 > 8), r (diagonal)
    assert (partial + full).tolist() == [1, 2] + [3] * (n - 2)
    assert full.sum() == 0  # no key block lies wholly inside a 12-token window below the diagonal
    wide = document_block_mask(ids, ids, 0, block, 17)  # 17 > 8 + 8: the previous block is full
    assert wide.full_kv_num_blocks[0, 0].tolist() == [0] + [1] * (n - 1)


@pytest.mark.parametrize("kernel", [DenseDocuments(), FlexDocuments(8)], ids=["dense", "flex"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("features", ["sinks", "softcap", "all_three"])
def test_sinks_softcap_scale_equal_the_naive_reference(cpu_flex, kernel, window, features):
    S = 40
    ids = torch.stack([_random_layout(S, 3), _random_layout(S, 4)])
    mask = kernel.mask(ids, ids, 0, window)
    sinks = torch.linspace(-1.5, 2.0, 4).requires_grad_()
    options = {"sinks": dict(sinks_H=sinks), "softcap": dict(softcap=1.7),
               "all_three": dict(sinks_H=sinks, softcap=2.5, scale=0.5)}[features]
    scale = options.get("scale")
    rest = {k: v for k, v in options.items() if k != "scale"}
    tensors = [*_qkv(2, 4, 2, S, S, 8, seed=7), sinks]
    dense_rule = dense_document_mask(ids, ids, 0, window)[:, 0]
    got = _out_and_grads(lambda q, k, v, s: kernel.attend(q, k, v, mask, scale, **rest), tensors)
    want = _out_and_grads(lambda q, k, v, s: naive_attention(q, k, v, dense_rule, scale, **rest), tensors)
    _assert_same(got, want)
    if "sinks_H" in rest:
        assert got[1][3].abs().sum() > 0  # the sink logits get a gradient


@pytest.mark.parametrize("documents", ["dense", "flex"])
@pytest.mark.parametrize("window", [None, 6, 64])  # 64: past the 30 tokens, plain causal
def test_strategy_without_documents_takes_window_sinks_softcap(cpu_flex, documents, window):
    """``prepare(None, window)`` needs no tensor; the call builds the mask from the queries' length."""
    kernel = FlexDocuments(8) if documents == "flex" else DenseDocuments()
    attention = CausalAttention(kernel)
    prepared = attention.prepare(None, window)
    assert prepared == (None if window is None else LengthMask(window))
    S = 30
    rule = naive_mask(None, None, S, S, 0, window)[None]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    tensors = [*_qkv(2, 4, 1, S, S, 8, seed=2), sinks]
    for extra in ({}, {"softcap": 3.0}, {"sinks_H": sinks}):
        got = _out_and_grads(lambda q, k, v, s: attention(q, k, v, prepared, **extra), tensors)
        want = _out_and_grads(lambda q, k, v, s: naive_attention(q, k, v, rule, **extra), tensors)
        _assert_same(got, want)


def test_prepare_with_documents_equals_window_rule_and_drops_a_window_past_the_sequence():
    attention = CausalAttention("dense")
    ids = torch.stack([_random_layout(24, 5), _random_layout(24, 6)])
    kernel, mask = attention.prepare(ids, 4)
    assert torch.equal(mask, dense_document_mask(ids, ids, 0, 4))
    _, wide = attention.prepare(ids, 24)  # every key of the sequence is inside the window
    assert torch.equal(wide, dense_document_mask(ids, ids, 0))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            attention.prepare(ids, bad)


@pytest.mark.parametrize("window", [None, 1, 5, 9])
@pytest.mark.parametrize("extra", ["plain", "sinks", "softcap", "scale"])
def test_cached_attention_equals_full_attention_row_by_row(window, extra):
    """Prefill of 6 tokens and then one token at a time, rows at different lengths in one batch, stale keys past
    each row's position in the cache (a reused slot): each new row equals the full causal attention's row."""
    B, H, KV, D, T = 2, 4, 2, 8, 20
    q_all, k_all, v_all = (t.detach() for t in _qkv(B, H, KV, T, T, D, seed=11))
    options = {"plain": {}, "sinks": dict(sinks_H=torch.tensor([0.3, -0.7, 1.1, 0.0])),
               "softcap": dict(softcap=2.0), "scale": dict(scale=0.4)}[extra]
    full = naive_attention(q_all, k_all, v_all, naive_mask(None, None, T, T, 0, window)[None], **options)
    cache_k = torch.randn(B, KV, T + 4, D)  # stale values everywhere before writing
    cache_v = torch.randn(B, KV, T + 4, D)
    key_index = torch.arange(T + 4)
    lengths = [T, T - 3]  # row 1 is shorter: its later positions hold stale keys
    start = torch.tensor([0, 0])
    steps = [6] + [1] * (T - 6)
    for n in steps:
        positions = start[:, None] + torch.arange(n)[None, :]
        positions = torch.minimum(positions, torch.tensor(lengths)[:, None] - 1)
        for b in range(B):
            cache_k[b, :, positions[b]] = k_all[b, :, positions[b]]
            cache_v[b, :, positions[b]] = v_all[b, :, positions[b]]
        q = torch.stack([q_all[b, :, positions[b]] for b in range(B)]).transpose(1, 2)  # (B, n, H, D)
        out = cached_attention(q, cache_k, cache_v, key_index, positions, window=window, **options)
        for b in range(B):
            want = full[b, :, positions[b]].transpose(0, 1)
            torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)
        start = start + n
