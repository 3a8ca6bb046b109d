"""``rows_by_order`` (the MoE's token rows in expert-sorted order) equals ``index_select`` forward and backward;
its backward is a permutation and a sum over k instead of index_select's atomic index_add (issue #32)."""

from __future__ import annotations

import torch

from mmtrain.parallel.moe_dispatch import rows_by_order, sort_by_expert


def test_rows_by_order_equals_index_select_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    N, K, D, E = 37, 3, 8, 5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    order, _ = sort_by_expert(ids, E)
    x = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    upstream = torch.randn(N * K, D, generator=g, dtype=torch.float64)
    out, expect = rows_by_order(x, order, K), ref.index_select(0, order // K)
    assert torch.equal(out, expect)
    (out * upstream).sum().backward()
    (expect * upstream).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=1e-12)
