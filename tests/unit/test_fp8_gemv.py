"""The FP8 decode kernel (mmtrain/model/fp8_gemv.py) on the CPU, under Triton's interpreter (a child process:
the interpreter is chosen when Triton is imported, and this process may have imported it already): its row scales
and quantized activations equal ``quantize_tokens_fp8`` bit for bit (zero rows, tiny values, ties, values at
448), and its product equals the dequantized reference to within the one rounding to bf16, with and without a
bias, one row and several, split over K (fp32 partials summed by the second kernel) or not, summed over K in
every step or once after the loop (``late_sum``). The GPU's speed and its agreement with ``torch._scaled_mm`` are
tests/gpu/test_quantize_gpu.py's business."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.unit

CHILD = r"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mmtrain.model import fp8_gemv
from mmtrain.model.quantized_linear import quantize_tokens_fp8


@triton.jit
def quantize_rows(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    ok = rows < M
    scale = fp8_gemv._row_scales(x_ptr, rows, ok, K, BLOCK_M, AMAX_K)
    tl.store(s_ptr + rows, scale, mask=ok)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], fp8_gemv._quantize(v.to(tl.float32), scale[:, None]),
                 mask=ok[:, None])


g = torch.Generator().manual_seed(0)
for m, k in ((1, 256), (3, 256), (5, 512)):
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]).bfloat16()
    if m == 3:
        x[1] = 0  # a zero row: the bf16 eps as its scale
        x[2, :8] = torch.tensor([1e-8, -3e-9, 2.0, -2.0, 0.5, 448.0, 1e-3, -7.0])  # subnormal FP8 values, 0
    # every representable bf16 magnitude class around the FP8 grid's ties: values k * 2^-12 for a scale of 1
    if m == 5:
        x[4] = torch.arange(k, dtype=torch.float32) * 2.0 ** -12
        x[4, -1] = 448.0
    q, s = torch.empty(m, k), torch.empty(m)
    quantize_rows[(1,)](x, q, s, m, k, BLOCK_M=triton.next_power_of_2(m), AMAX_K=64, BLOCK_K=128)
    x_q, x_s = quantize_tokens_fp8(x)
    assert torch.equal(s, x_s.float()[:, 0]), ("scales", m, k)
    assert torch.equal(q, x_q.float()), ("values", m, k, (q - x_q.float()).abs().max())

C = fp8_gemv.Config
cases = [(1, 48, 256, False, None), (3, 48, 256, True, None),
         (2, 32, 512, True, C(16, 64, 4, 4, 2)), (1, 32, 512, False, C(16, 128, 2, 4, 2)),
         (1, 64, 256, False, C(16, 64, 1, 4, 2, True)), (5, 96, 512, True, C(32, 64, 2, 4, 2, True))]
for m, n, k, bias, config in cases:
    w = torch.randn(n, k, generator=g)
    w_s = (w.abs().amax(1, keepdim=True) / 448).bfloat16()
    w_q = (w / w_s.float()).to(torch.float8_e4m3fn)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    if config is None:
        y = fp8_gemv.fp8_linear(x, w_q, w_s, b)  # the registered op, its table/default config
    else:
        y = fp8_gemv.launch(x, w_q, w_s, b, config)
    x_q, x_s = quantize_tokens_fp8(x)
    ref = F.linear(x_q.float() * x_s.float(), w_q.float() * w_s.float(), None if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # one rounding of an fp32 sum to bf16: within half a bf16 ulp (2^-9 relative), plus fp32 summation order
    torch.testing.assert_close(y.float(), ref, rtol=2.0 ** -8, atol=1e-4 * ref.abs().max().item())
print("ok")
"""


def test_kernel_quantizes_and_multiplies_as_the_reference_under_the_interpreter():
    run_interpreted(CHILD)


def test_configs_fit_the_shapes():
    pytest.importorskip("triton", reason="the FP8 decode kernel is written in Triton")
    from mmtrain.model import fp8_gemv

    for (n, k), table in fp8_gemv.CONFIGS.items():
        assert fp8_gemv.config_for(1, n, k) == table
    for m in (1, 2, 3, 8, 16):
        for n, k in [*fp8_gemv.CONFIGS, (48, 256), (4096, 14336), (128256, 2048), (16, 16)]:
            c = fp8_gemv.config_for(m, n, k)
            assert (k // c.split) % c.block_k == 0 and k % c.split == 0 and c.block_k >= 16
            assert triton_pow2(m) * c.block_n * c.block_k <= fp8_gemv._PRODUCTS or c.block_k == 16
            late = fp8_gemv.fit(c._replace(late_sum=True), m, k)  # its accumulator: a smaller cap
            assert triton_pow2(m) * late.block_n * late.block_k <= fp8_gemv._LATE_PRODUCTS or late.block_k == 16
    assert not fp8_gemv.supported(17, 2048, 2048) and not fp8_gemv.supported(1, 2048, 2040)


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()
