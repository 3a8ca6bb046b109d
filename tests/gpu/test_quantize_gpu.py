"""The quantized linears' CUDA kernels against their CPU formulas (mmtrain/model/quantized_linear.py): FP8 through
``torch._scaled_mm`` with row-wise scales, int4 through tinygemm (``aten._weight_int4pack_mm``) after the repack;
and a quantized model decoded compiled (CUDA graphs) on the GPU.

Tolerances: the kernels accumulate in fp32 and round the output to bf16 once, as the CPU path's bf16 ``F.linear``
does, but in another order; the comparison is on fp32 references with bf16's relative precision (2^-8) times the
dot-product length's growth, 2e-2 of the output's scale."""

from __future__ import annotations

import pytest
import torch

from mmtrain.model.quantized_linear import QuantizedLinear, quantize_tokens_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp8_scaled_mm_equals_the_dequantized_product(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(512, 2048, generator=g)
    scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
    linear = QuantizedLinear.from_values("fp8", (w / scale.float()).to(torch.float8_e4m3fn), scale,
                                         torch.randn(512, generator=g).to(torch.bfloat16)).cuda()
    x = torch.randn(rows, 2048, generator=g).to(torch.bfloat16).cuda()
    x_q, x_s = quantize_tokens_fp8(x)
    expected = ((x_q.float() * x_s.float()) @ (linear.weight.float() * linear.weight_scale.float()).t()
                + linear.bias.float())
    _close(linear(x), expected)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_tinygemm_equals_the_dequantized_product(rows):
    g = torch.Generator().manual_seed(rows)
    values = torch.randint(-8, 8, (512, 2048), generator=g, dtype=torch.int8)
    scales = (torch.rand(512, 16, generator=g) * 0.02).to(torch.bfloat16)
    linear = QuantizedLinear.from_values("w4a16", values, scales, group_size=128).cuda()
    expected_w = linear.dequantized(torch.float32)
    x = torch.randn(rows, 2048, generator=g).to(torch.bfloat16).cuda()
    eager = linear(x)  # the dequantizing path, before the repack
    assert linear.use_cuda_kernel() and linear.tinygemm
    assert linear.weight.shape == (512, 2048 // 8)  # tinygemm's tiles viewed as rows
    _close(linear(x), x.float() @ expected_w.t())
    _close(eager, x.float() @ expected_w.t())


def test_a_quantized_model_decodes_compiled_on_the_gpu(tmp_path):
    """A W4A16 and an FP8 folder of a random model whose widths fit the kernels (128) decode compiled (CUDA graphs)
    as eager: every new token, the first (the prefill's argmax) equal. Later tokens may part at a near-tie of a
    random model's logits (tests/gpu/test_generate_gpu.py says why), so they are not compared."""
    from mmtrain.convert.checkpoint_io import write_weights_checkpoint
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.inference.engine import DecodeEngine, generate
    from mmtrain.inference.loading import prepare_for_decoding
    from mmtrain.inference.quantized_loading import load_quantized_model, use_quantized_kernels
    from mmtrain.inference.sampling import SamplingParams
    from mmtrain.quantize.run import QuantizeSettings, quantize_checkpoint
    from tests.inference_helpers import tiny_config, tiny_model, tiny_tokenizer

    cfg = tiny_config(hidden_size=128, ffn_hidden_size=256, init_std=0.05)
    tok = load_tokenizer(tiny_tokenizer(tmp_path / "tok"))
    write_weights_checkpoint(tmp_path / "ckpt", {k: v.clone() for k, v in tiny_model(cfg).state_dict().items()},
                             cfg, extra_meta={"tokenizer": tok.describe()})
    for scheme in ("w4a16", "fp8"):
        folder = quantize_checkpoint(tmp_path / "ckpt", tmp_path / scheme, QuantizeSettings(scheme),
                                     log=lambda line: None)
        model, _ = load_quantized_model(folder)
        model = prepare_for_decoding(model, "cuda", torch.bfloat16)
        assert use_quantized_kernels(model) == (8 if scheme == "w4a16" else 0)
        prompts = [[5, 6, 7, 8, 9], [11, 12]]
        eager = generate(DecodeEngine(model, 2, 64), prompts, [SamplingParams(16)] * 2)
        compiled = generate(DecodeEngine(model, 2, 64, compile=True), prompts, [SamplingParams(16)] * 2)
        assert [len(s.token_ids) for s in compiled] == [16, 16] and all(s.error is None for s in compiled)
        assert [s.token_ids[0] for s in compiled] == [s.token_ids[0] for s in eager], scheme


def _fp8_linear(n: int, k: int, bias: bool, seed: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return QuantizedLinear.from_values("fp8", (w / scale.float()).to(torch.float8_e4m3fn), scale, b).cuda()


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)])
def test_fp8_decode_kernel_equals_scaled_mm_at_the_1b_shapes(n, k, rows):
    """At most 16 rows the FP8 linear is the Triton kernel (mmtrain/model/fp8_gemv.py); it equals the
    ``_scaled_mm`` path (the same quantized activations; the sums in another order) within bf16's tolerance."""
    from mmtrain.model import fp8_gemv

    linear = _fp8_linear(n, k, bias=rows == 5, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).cuda()
    x_q, x_s = quantize_tokens_fp8(x)
    scaled = torch._scaled_mm(x_q, linear.weight.t(), scale_a=x_s.float(), scale_b=linear.weight_scale.float().t(),
                              out_dtype=torch.bfloat16)
    if linear.bias is not None:
        scaled = scaled + linear.bias
    got = fp8_gemv.fp8_linear(x, linear.weight, linear.weight_scale, linear.bias)
    _close(got, scaled.float())
    _close(linear(x), scaled.float())  # QuantizedLinear takes the kernel at this size
    expected = (x_q.float() * x_s.float()) @ (linear.weight.float() * linear.weight_scale.float()).t()
    _close(got, expected + (linear.bias.float() if linear.bias is not None else 0))
    for late_sum in (False, True):  # both ways to sum, whichever the table picks for this shape
        config = fp8_gemv.fit(fp8_gemv.Config(16, 256, 2, 4, 3, late_sum), rows, k)
        _close(fp8_gemv.launch(x.contiguous(), linear.weight, linear.weight_scale, linear.bias, config),
               scaled.float())


def test_fp8_decode_kernel_runs_compiled_with_cuda_graphs():
    """torch.compile traces into the triton_op and "reduce-overhead" replays it from a CUDA graph: the same
    output as eager, on new inputs copied into the same static input too."""
    linear = _fp8_linear(2048, 8192, bias=True, seed=0)  # split over K: two kernels in the graph
    compiled = torch.compile(linear, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        x = torch.randn(1, 8192, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
        eager = linear(x)
        torch.compiler.cudagraph_mark_step_begin()
        assert torch.equal(compiled(x), eager)
    static_x = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
    small = _fp8_linear(3072, 2048, bias=False, seed=1)
    small(static_x)  # compile before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = small(static_x)
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_y, small(x))
