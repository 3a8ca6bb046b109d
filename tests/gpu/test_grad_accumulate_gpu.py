"""On CUDA, gradients reach the fp32 buffers through the Triton kernel, bit-identical to PyTorch's copy_ / add_."""

from __future__ import annotations

import pytest
import torch

from mmtrain.parallel.grad_accumulate import write_grad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n", [1, 4097, 3 * 2**20 + 5])
def test_write_grad_on_cuda_equals_torch(n):
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(n, device="cuda", generator=g).bfloat16()
    start = torch.randn(n, device="cuda", generator=g)
    copied, added = start.clone(), start.clone()
    write_grad(copied, grad, first=True)
    write_grad(added, grad, first=False)
    assert torch.equal(copied, grad.float())
    assert torch.equal(added, start + grad)
