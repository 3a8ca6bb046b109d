"""The FP8 linear of a few tokens (decode) as one Triton kernel: per-token activation quantization and the product.

``QuantizedLinear._fp8`` otherwise runs ``quantize_tokens_fp8`` (several elementwise and reduction kernels) and
``torch._scaled_mm``, whose CUTLASS kernel is poorly tuned at M = 1: on the H200 the FP8 1B model decoded slower
than bf16. Here every program of the kernel reads its rows of ``x`` whole, takes each row's amax itself (K is at
most ~16k bf16 values, read from L2: cheaper than a second kernel in the CUDA graph), quantizes its slice of K as
``quantize_tokens_fp8`` does and multiplies it with a (BLOCK_N, K-slice) tile of the FP8 weight on CUDA cores in
fp32. At M <= 16 the product is bound by reading the weight, so the grid is sized to give 132 SMs enough programs:
narrow outputs with wide inputs (the MLP's down projection) split K, each split writing fp32 partials that a second
tiny kernel sums (deterministic, no atomics, no buffer to zero: CUDA-graph safe).

Two ways to sum over K, chosen per shape by ``Config.late_sum``: each loop step reduces its (BLOCK_N, BLOCK_K)
products to BLOCK_N sums (shuffles across the threads that hold one row's K, in every step), or the products are
accumulated elementwise in registers and reduced once after the loop (no shuffles in the loop; fewer K per step,
so that the (BLOCK_M, BLOCK_N, BLOCK_K) accumulator fits in registers). A tensor-core variant (``tl.dot`` on the
FP8 weight tile and the tokens padded to 16, "swap AB") was measured 3-10x slower at every Llama-3.2-1B shape in
session 17 (bench/results/h200_2026-12-04_s17.md) and is not kept.

Configs come from a fixed table by (N, K) (``CONFIGS``; picked with bench/fp8_gemv.py on the H200), never from
run-time autotuning, which would time kernels inside a CUDA-graph capture. ``fp8_linear`` is a ``triton_op``, so
torch.compile traces into it and the decode step's CUDA graphs capture its launches.
"""

from typing import NamedTuple

import torch

try:  # Triton ships with CUDA builds of torch; a CPU-only install may lack it (``supported`` is then False)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without Triton
    triton = None

MAX_ROWS = 16  # tokens per call up to which the kernel is used (decode); more go to torch._scaled_mm
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
BF16_EPS = torch.finfo(torch.bfloat16).eps  # a zero row's scale, as quantize_tokens_fp8 sets it


class Config(NamedTuple):
    """One launch: tiles of ``block_n`` weight rows by ``block_k`` inputs, K split in ``split`` (fp32 partials
    summed by a second kernel), ``warps`` and ``stages`` (loads in flight); ``late_sum``: products accumulated
    elementwise and summed over K once after the loop, not in every step."""

    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int
    late_sum: bool = False


# (N, K) -> Config at M = 1, Llama-3.2-1B's linears: the fastest of bench/fp8_gemv.py's candidates on the H200
# (session 17, weights rotating past L2; us: this config vs the _scaled_mm path vs bf16 F.linear): qkv 5.8 vs 24.6
# vs 6.1, o 5.1 vs 25.0 vs 6.0, gate_up 13.6 vs 30.4 vs 17.8, down 10.7 vs 39.0 vs 13.4. The late sum wins at every
# shape (the per-step reduction: 7.2, 6.0, 19.3, 13.4); narrow tiles (many programs resident per SM), N 2048 with
# K 8192 split in 4.
CONFIGS = {
    (3072, 2048): Config(8, 512, 1, 4, 3, True),
    (2048, 2048): Config(8, 512, 1, 4, 3, True),
    (16384, 2048): Config(32, 128, 1, 4, 4, True),
    (2048, 8192): Config(16, 256, 4, 4, 4, True),
}
_PRODUCTS = 16384  # BLOCK_M * BLOCK_N * BLOCK_K cap: the broadcast product lives in registers
_LATE_PRODUCTS = 8192  # the cap with late_sum: an accumulator of that size stays in registers all the loop


def supported(m: int, n: int, k: int) -> bool:
    """Shapes the kernel takes: a few rows, K and N multiples of 16 (16-byte rows of the FP8 weight)."""
    return triton is not None and 1 <= m <= MAX_ROWS and k % 16 == 0 and n % 16 == 0


def config_for(m: int, n: int, k: int) -> Config:
    """The table's config for (N, K), or a default by the same reasoning, fitted to the shape: block sizes cut
    so that the broadcast product (or the late sum's accumulator) fits in registers at more rows, and BLOCK_K a
    divisor of each split's slice of K (no K mask)."""
    if k >= max(4 * n, 8192):  # few outputs, long rows (a down projection): split K, as the table's down
        default = Config(16, 256, 4, 4, 4, True)
    elif n <= 4096:  # narrow tiles for many programs, as the table's qkv and o
        default = Config(8, 512, 1, 4, 3, True)
    else:  # wide outputs (gate_up): the table's gate_up tiles
        default = Config(32, 128, 1, 4, 4, True)
    return fit(CONFIGS.get((n, k), default), m, k)


def fit(config: Config, m: int, k: int) -> Config:
    """``config`` made valid for M = ``m`` rows and K = ``k`` (see ``config_for``)."""
    bk, split = config.block_k, config.split
    bm = 1 << (m - 1).bit_length()
    cap = _LATE_PRODUCTS if config.late_sum else _PRODUCTS
    while bm * config.block_n * bk > cap and bk > 16:
        bk //= 2
    while split > 1 and (k % split or (k // split) % 16):
        split //= 2
    while (k // split) % bk:
        bk //= 2  # ends at 16 at the latest: K / split is a multiple of 16
    return config._replace(block_k=bk, split=split)


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)  # globals a jit function reads must be constexpr
    _EPS = tl.constexpr(BF16_EPS)

    @triton.jit
    def _round_bf16(a):
        """Non-negative fp32 -> the nearest bf16 value (ties to even), still fp32: keep the high 16 bits."""
        b = a.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def to_bf16(y):
        """fp32 -> bf16, rounded to nearest even in bits first: the cast is then exact on the GPU and under the
        interpreter (whose own cast truncates). Shared with ``mmtrain.model.decode_attention``."""
        a = _round_bf16(tl.abs(y))
        return tl.where(y < 0.0, -a, a).to(tl.bfloat16)

    @triton.jit
    def _round_e4m3(a):
        """Non-negative fp32 <= 448 -> the nearest float8 E4M3 value (ties to even), still fp32: 3 mantissa bits
        from 2^-6 up, multiples of 2^-9 below (subnormals; the magic 1.5 * 2^23 rounds to an integer)."""
        b = a.to(tl.int32, bitcast=True)
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        subnormal = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        return tl.where(a >= 0.015625, normal, subnormal)

    @triton.jit
    def _row_scales(x_ptr, rows, row_ok, K: tl.constexpr, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr):
        """Each row's scale as quantize_tokens_fp8 computes it: bf16(amax / 448), a zero row's the bf16 eps."""
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, AMAX_K):
            cols = k0 + tl.arange(0, AMAX_K)
            v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
        scale = _round_bf16(tl.math.div_rn(amax, tl.full([BLOCK_M], _FP8_MAX, tl.float32)))
        return tl.where(scale == 0.0, _EPS, scale)

    @triton.jit
    def _quantize(v, scale):
        """bf16 values (as fp32) -> their FP8 values (as fp32): bf16(v / scale) clamped to +-448, then E4M3;
        the division rounded as IEEE does (Triton's plain fp32 division is approximate)."""
        q = tl.math.div_rn(v, scale)
        a = tl.minimum(_round_bf16(tl.abs(q)), _FP8_MAX)
        a = _round_e4m3(a)
        return tl.where(q < 0.0, -a, a)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, K_SLICE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, AMAX_K: tl.constexpr, STAGES: tl.constexpr,
                         LATE_SUM: tl.constexpr):
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x_scale = _row_scales(x_ptr, rows, row_ok, K, BLOCK_M, AMAX_K)
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)  # LATE_SUM's accumulator (else unused)
        # num_stages on the loop pipelines the weight loads although there is no tl.dot (loads in flight)
        for k0 in tl.range(0, K_SLICE, BLOCK_K, num_stages=STAGES):  # K constexpr: one compile per layer shape
            cols_k = pid_s * K_SLICE + k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + rows[:, None] * K + cols_k[None, :], mask=row_ok[:, None], other=0.0)
            q = _quantize(v.to(tl.float32), x_scale[:, None])
            w = tl.load(w_ptr + cols_n[:, None].to(tl.int64) * K + cols_k[None, :], mask=n_ok[:, None], other=0.0)
            if LATE_SUM:
                products += q[:, None, :] * w.to(tl.float32)[None, :, :]
            else:
                acc += tl.sum(q[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if LATE_SUM:
            acc = tl.sum(products, axis=2)
        y = acc * x_scale[:, None] * tl.load(ws_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        offsets = rows[:, None] * N + cols_n[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                y += tl.load(b_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offsets, to_bf16(y), mask=mask)
        else:  # fp32 partials (SPLIT, M, N), summed by _sum_splits_kernel
            tl.store(out_ptr + pid_s * M * N + offsets, y, mask=mask)

    @triton.jit
    def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < M * N
        y = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: the same sum every call
            y += tl.load(part_ptr + s * M * N + offsets, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + offsets % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, to_bf16(y), mask=ok)

    @torch.library.triton_op("mmtrain::fp8_linear", mutates_args=())
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """``quantize_tokens_fp8(x)`` times ``weight`` (FP8 (N, K)) with the row scales ``weight_scale`` (N, 1),
        plus ``bias``: (M, N) bf16, for bf16 ``x`` of M <= MAX_ROWS rows (``supported``)."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"fp8_linear takes bf16 activations, got {x.dtype}")
        x = x.contiguous()
        return launch(x, weight, weight_scale, bias, config_for(x.shape[0], weight.shape[0], x.shape[1]))

    def _traced(kernel):
        """The kernel as torch.compile traces it; under TRITON_INTERPRET=1 (the CPU tests) ``triton.jit`` returns
        an interpreted function, which ``wrap_triton`` refuses: then the plain function."""
        interpreted = not isinstance(kernel, triton.runtime.jit.JITFunction)
        return kernel if interpreted else torch.library.wrap_triton(kernel)

    def launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               config: Config) -> torch.Tensor:
        """The kernel(s) at an explicit ``config`` (the bench tries several; ``fit`` it first); x (M, K)
        contiguous."""
        (m, k), n = x.shape, weight.shape[0]
        bn, bk, split, warps, stages, late_sum = config
        bm = triton.next_power_of_2(m)
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
        has_bias = bias is not None
        bias_arg = bias if has_bias else weight_scale  # any pointer: not read without HAS_BIAS
        amax_k = min(triton.next_power_of_2(k), max(8192 // bm, 64))
        _traced(_fp8_gemv_kernel)[(triton.cdiv(n, bn), split)](
            x, weight, weight_scale, bias_arg, target, m, n, k, k // split, HAS_BIAS=has_bias, SPLIT=split,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, AMAX_K=amax_k, STAGES=stages, LATE_SUM=late_sum, num_warps=warps)
        if split > 1:
            _traced(_sum_splits_kernel)[(triton.cdiv(m * n, 1024),)](
                target, bias_arg, out, m, n, HAS_BIAS=has_bias, SPLIT=split, BLOCK=1024, num_warps=4)
        return out
