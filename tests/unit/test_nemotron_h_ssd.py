"""The Mamba-2 SSD scan in PyTorch (mmtrain/models/nemotron_h/ssd.py) against the recurrence written token by
token: any chunk size (also longer than the sequence, or not dividing it), groups shared by several heads, packed
documents resetting the state, an initial state continued, one decoding step; gradients flow to every input."""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.nemotron_h.ssd import ssd_chunked_scan, ssd_scan, ssd_step

pytestmark = pytest.mark.unit

BATCH, SEQ, HEADS, P, GROUPS, N = 2, 23, 6, 4, 2, 5


def _inputs(seed: int = 0, seq: int = SEQ, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, HEADS, P, generator=g, dtype=dtype)
    dt = torch.rand(BATCH, seq, HEADS, generator=g, dtype=dtype) * 0.6 + 0.01  # softplus'ed: positive
    A = -torch.rand(HEADS, generator=g, dtype=dtype) * 3 - 0.1
    B = torch.randn(BATCH, seq, GROUPS, N, generator=g, dtype=dtype)
    C = torch.randn(BATCH, seq, GROUPS, N, generator=g, dtype=dtype)
    return x, dt, A, B, C


def _recurrence(x, dt, A, B, C, doc_ids=None, initial=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, one token at a time in float64, written out here
    (head h reads group h // (H / G)); the state restarts at zero where the document id changes."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    group = torch.arange(HEADS) // (HEADS // GROUPS)
    Bh, Ch = B[:, :, group], C[:, :, group]  # (b, s, h, n)
    h = torch.zeros(BATCH, HEADS, P, N, dtype=torch.float64) if initial is None else initial.double().clone()
    ys = []
    for t in range(x.shape[1]):
        if doc_ids is not None and t > 0:
            h = h * (doc_ids[:, t] == doc_ids[:, t - 1]).double()[:, None, None, None]
        h = (dt[:, t] * A).exp()[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("chunk", [1, 4, 5, 8, 64])  # 23 tokens: never a multiple, 64 longer than the sequence
def test_chunked_scan_equals_the_recurrence(chunk):
    x, dt, A, B, C = _inputs()
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk)
    y_ref, final_ref = _recurrence(x, dt, A, B, C)
    assert y.dtype == torch.float32 and final.shape == (BATCH, HEADS, P, N)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), final_ref, rtol=1e-5, atol=1e-5)
    assert ssd_scan(x, dt, A, B, C, chunk)[0].equal(y)  # what the mixer calls is the same scan here


@pytest.mark.parametrize("chunk", [4, 7])
def test_documents_reset_the_state(chunk):
    """A packed row (documents of 5, 9, 1 and 8 tokens; boundaries inside and on chunk edges) equals each
    document scanned alone; the final state is the last document's."""
    x, dt, A, B, C = _inputs(seed=1)
    lengths = [5, 9, 1, 8]
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(BATCH, SEQ)
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk, doc_ids_BS=doc_ids.contiguous())
    torch.testing.assert_close(y.double(), _recurrence(x, dt, A, B, C, doc_ids)[0], rtol=1e-5, atol=1e-5)
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        alone, alone_final = ssd_chunked_scan(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], chunk)
        torch.testing.assert_close(y[:, piece], alone, rtol=1e-5, atol=1e-5)
        start += length
    torch.testing.assert_close(final, alone_final, rtol=1e-5, atol=1e-5)


def test_an_initial_state_continues_a_scan():
    """Scanning [a; b] equals scanning b from a's final state (a prompt prefilled in pieces); with documents the
    initial state belongs to the row's first document and is dropped where the next one starts."""
    x, dt, A, B, C = _inputs(seed=2)
    whole, whole_final = ssd_chunked_scan(x, dt, A, B, C, 4)
    cut = 10
    _, mid = ssd_chunked_scan(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], 4)
    rest, rest_final = ssd_chunked_scan(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], 4, initial_state_BHPN=mid)
    torch.testing.assert_close(rest, whole[:, cut:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest_final, whole_final, rtol=1e-5, atol=1e-5)

    initial = torch.randn(BATCH, HEADS, P, N, generator=torch.Generator().manual_seed(3))
    doc_ids = (torch.arange(SEQ) >= 6).long().expand(BATCH, SEQ).contiguous()  # the second document at token 6
    y, _ = ssd_chunked_scan(x, dt, A, B, C, 4, doc_ids_BS=doc_ids, initial_state_BHPN=initial)
    torch.testing.assert_close(y.double(), _recurrence(x, dt, A, B, C, doc_ids, initial)[0], rtol=1e-5, atol=1e-5)


def test_a_step_is_one_token_of_the_scan():
    x, dt, A, B, C = _inputs(seed=4)
    _, state = ssd_chunked_scan(x[:, :-1], dt[:, :-1], A, B[:, :-1], C[:, :-1], 8)
    y, new_state = ssd_step(state, x[:, -1], dt[:, -1], A, B[:, -1], C[:, -1])
    whole, whole_final = ssd_chunked_scan(x, dt, A, B, C, 8)
    torch.testing.assert_close(y, whole[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, whole_final, rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_compute_in_fp32_and_gradients_reach_every_input():
    x, dt, A, B, C = _inputs(seed=5)
    y16, final16 = ssd_chunked_scan(*(t.bfloat16() for t in (x, dt, A, B, C)), 4)
    assert y16.dtype == torch.bfloat16 and final16.dtype == torch.float32
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    y, final = ssd_chunked_scan(*leaves, 4)
    (y.square().sum() + final.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in leaves)


def test_mismatched_shapes_are_one_line():
    x, dt, A, B, C = _inputs()
    with pytest.raises(ValueError, match=r"^ssd scan: shapes x .* do not agree"):
        ssd_chunked_scan(x, dt[:, :-1], A, B, C, 4)
    with pytest.raises(ValueError, match=r"^ssd scan: 6 heads cannot share 4 groups"):
        ssd_chunked_scan(x, dt, A, B.repeat(1, 1, 2, 1), C.repeat(1, 1, 2, 1), 4)
