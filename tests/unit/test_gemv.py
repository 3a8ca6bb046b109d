"""The bf16 decode linear (mmtrain/model/gemv.py) on the CPU, under Triton's interpreter (a child process, as
tests/unit/test_fp8_gemv.py): its product equals ``F.linear`` to within the one rounding to bf16, with and without
a bias, one row and several, a ragged last tile of outputs, split over K (fp32 partials summed by the second
kernel) or not; the gated kernel equals ``silu(gate) * up`` of the rounded halves. The decode-time swap
(``mmtrain.inference.decode_linears``) is tests/unit/test_decode_fast_paths.py's; the GPU's agreement under
torch.compile and CUDA graphs is tests/gpu/test_generate_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.unit

CHILD = r"""
import torch
import torch.nn.functional as F

from mmtrain.model import gemv

g = torch.Generator().manual_seed(0)
C = gemv.Config
cases = [(1, 48, 256, False, None), (3, 40, 256, True, None), (2, 32, 512, True, C(8, 64, 4, 4, 2)),
         (1, 24, 512, False, C(16, 128, 2, 4, 2)), (4, 64, 128, False, C(4, 32, 1, 2, 2))]
for gated in (False, True):
    for m, n, k, bias, config in cases:
        w = (torch.randn(2 * n if gated else n, k, generator=g) * 0.1).bfloat16()
        b = torch.randn(w.shape[0], generator=g).bfloat16() if bias else None
        x = torch.randn(m, k, generator=g).bfloat16()
        if config is None:  # the registered ops, their default configs
            y = (gemv.gated_linear if gated else gemv.linear)(x, w, b)
        else:
            y = gemv.launch(x, w, b, gemv.fit(config, m, k, gated), gated)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        if gated:  # each half rounded to bf16 as the linear's output is, the activation in fp32
            gate, up = ref.bfloat16().float().chunk(2, dim=-1)
            ref = F.silu(gate) * up
        assert y.dtype == torch.bfloat16 and y.shape == (m, n), (y.shape, m, n)
        # one rounding of an fp32 sum to bf16 (half an ulp, 2^-9 relative) plus the summation order; gated: a
        # half may round the other way too
        tol = 2.0 ** (-7 if gated else -8)
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=1e-3 * ref.abs().max().item())
print("ok")
"""


def test_kernel_multiplies_as_f_linear_under_the_interpreter():
    run_interpreted(CHILD)


def test_configs_fit_the_shapes():
    pytest.importorskip("triton", reason="the decode linear is written in Triton")
    from mmtrain.model import gemv

    for (n, k), table in gemv.CONFIGS.items():
        assert gemv.config_for(1, n, k, gated=n == 8192) == table
    for m in range(1, gemv.MAX_ROWS + 1):
        for n, k in [*gemv.CONFIGS, (48, 256), (4096, 14336), (14336, 4096), (16, 8)]:
            for gated in (False, True):
                c = gemv.config_for(m, n, k, gated)
                assert (k // c.split) % c.block_k == 0 and k % c.split == 0 and c.block_k >= 8
                bm = 1 << (m - 1).bit_length()
                assert bm * c.block_n * c.block_k * (1 + gated) <= gemv._PRODUCTS or c.block_k == 8
    bf16 = torch.bfloat16
    assert gemv.supported(1, 2048, 2048, bf16) and gemv.supported(gemv.GATED_MAX_ROWS, 2048, 2048, bf16, True)
    assert not gemv.supported(gemv.MAX_ROWS + 1, 2048, 2048, bf16)
    assert not gemv.supported(gemv.GATED_MAX_ROWS + 1, 2048, 2048, bf16, True)
    assert not gemv.supported(1, 2048, 2044, bf16) and not gemv.supported(1, 2048, 2048, torch.float16)


def test_the_ops_refuse_what_they_cannot_multiply():
    """Wrong dtypes, a weight of another width, an odd gated weight: one-line errors before any launch."""
    pytest.importorskip("triton", reason="the decode linear is written in Triton")
    from mmtrain.model import gemv

    bf16 = torch.bfloat16
    x, w = torch.zeros(1, 64, dtype=bf16), torch.zeros(32, 64, dtype=bf16)
    cases = [(gemv.linear, x.float(), w, "gemv takes"), (gemv.linear, x, w.half(), "gemv takes"),
             (gemv.linear, torch.zeros(1, 48, dtype=bf16), w, "gemv takes"),
             (gemv.gated_linear, x, torch.zeros(33, 64, dtype=bf16), "is not \\[gate \\| up\\]")]
    for op, a, b, message in cases:
        with pytest.raises(ValueError, match=message):
            op(a, b, None)
