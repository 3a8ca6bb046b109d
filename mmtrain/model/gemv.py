"""The bf16 linear of a few tokens (decode) as one Triton kernel, optionally with the SwiGLU of a fused gate|up.

At batch 1 a decode step multiplies one row by each weight matrix: bound by reading the weights, and the step's
small matrices (the 1B model's attention projections: 8-12 MB) by how fast the reading starts and ends, which
cuBLAS's GEMV does not tune for (it read them at ~2 TB/s on the H200), nor the down projection's few output tiles
(``bench/gemv.py``). Here each program reads ``BLOCK_N`` whole weight rows in ``BLOCK_K`` slices with several
slices in flight (``num_stages`` on the loop), multiplies them with the few token rows on CUDA cores in fp32 and
sums over K once after the loop (products accumulated elementwise in registers: no shuffles in the loop, as
``fp8_gemv``'s late sum); narrow outputs with wide inputs split K over programs, each split writing fp32 partials
that a second tiny kernel sums in a fixed order (deterministic, no atomics, no buffer to zero: CUDA-graph safe).

``gated``: the weight is a fused ``[gate | up]`` (2F, K) and the output ``silu(gate) * up`` (F wide): one program
reads gate row j and up row j together, so the MLP's activation is the product's epilogue (no (M, 2F) tensor
written and read back, one launch less). Each of gate and up is rounded to bf16 first, as the linear's output is;
the activation then runs in fp32 and is rounded once, as Inductor's fused activation kernel computes it.

Configs come from a fixed table by (N, K) (``CONFIGS``, picked with ``bench/gemv.py`` on the H200), never from
run-time autotuning, which would time kernels inside a CUDA-graph capture. ``linear`` and ``gated_linear`` are
``triton_op``s, so torch.compile traces into them and the decode step's CUDA graphs capture their launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmtrain.model import fp8_gemv

triton = fp8_gemv.triton
if triton is not None:
    import triton.language as tl

# tokens per call up to which the kernel is used; more go to cuBLAS (bench/gemv.py --rows 1 2 4 8: at 2 rows the
# kernel still won at every 1B shape but the gated one, at 4 it lost at most)
MAX_ROWS = 2
GATED_MAX_ROWS = 1
DTYPES = (torch.bfloat16,)  # the epilogue rounds to bf16 (fp8_gemv.to_bf16)


class Config(NamedTuple):
    """One launch: tiles of ``block_n`` weight rows by ``block_k`` inputs, K split in ``split`` (fp32 partials
    summed by a second kernel), ``warps`` and ``stages`` (weight slices in flight)."""

    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


# (N, K) -> Config at M = 1 for Llama-3.2-1B's linears (gate_up as the gated kernel sees it: N = F = 8192 outputs
# of 2F weight rows): the fastest of bench/gemv.py's candidates on the H200 (session 23, weights rotating past L2;
# us, this config vs cuBLAS): qkv 5.50 vs 6.05, o 4.48 vs 6.04, gate_up with SwiGLU 18.26 vs 19.31 (F.linear and
# Inductor's activation kernel), down 10.25 vs 14.06 (12.13 for the split-K batched matmul used until then). Narrow
# tiles (many programs resident per SM, so the weight's reading starts everywhere at once); no split of K: the
# fp32 partials' second kernel cost more than the programs it added.
CONFIGS = {
    (3072, 2048): Config(8, 512, 1, 4, 3),
    (2048, 2048): Config(4, 512, 1, 4, 3),
    (8192, 2048): Config(2, 512, 1, 2, 3),
    (2048, 8192): Config(4, 512, 1, 4, 4),
}
_PRODUCTS = 8192  # BLOCK_M * BLOCK_N * BLOCK_K (twice that gated) cap: the accumulator stays in registers


def supported(m: int, n: int, k: int, dtype: torch.dtype, gated: bool = False) -> bool:
    """Calls the kernel takes: a few rows of a supported dtype, K a multiple of 8 (16-byte weight rows)."""
    rows = GATED_MAX_ROWS if gated else MAX_ROWS
    return triton is not None and 1 <= m <= rows and k % 8 == 0 and n >= 1 and dtype in DTYPES


def config_for(m: int, n: int, k: int, gated: bool = False) -> Config:
    """The table's config for (N, K) (N: outputs, F when ``gated``), or a default by the same reasoning, fitted
    to the shape (``fit``)."""
    if gated:
        default = Config(2, 512, 1, 2, 3)
    elif k >= max(2 * n, 8192):  # few outputs, long rows (a down projection)
        default = Config(4, 512, 1, 4, 4)
    else:
        default = Config(4 if n <= 2048 else 8, 512, 1, 4, 3)
    return fit(CONFIGS.get((n, k), default), m, k, gated)


def fit(config: Config, m: int, k: int, gated: bool = False) -> Config:
    """``config`` made valid for M = ``m`` rows and K = ``k``: BLOCK_K cut until the accumulators fit in
    registers at that many rows, the split a divisor of K into slices of multiples of 8, BLOCK_K a divisor of
    each slice (no K mask)."""
    bk, split = config.block_k, config.split
    bm = 1 << (m - 1).bit_length()
    while bm * config.block_n * bk * (2 if gated else 1) > _PRODUCTS and bk > 8:
        bk //= 2
    while split > 1 and (k % split or (k // split) % 8):
        split //= 2
    while (k // split) % bk:
        bk //= 2  # ends at 8 at the latest: K / split is a multiple of 8
    return config._replace(block_k=bk, split=split)


if triton is not None:
    to_bf16 = fp8_gemv.to_bf16

    @triton.jit
    def _silu_times(g, u):
        """silu(g) * u in fp32 (g and u already bf16 values), the exponential as Inductor's sigmoid takes it."""
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, K_SLICE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols_n < N
        w_rows = w_ptr + cols_n[:, None].to(tl.int64) * K
        up_rows = w_rows + N * K  # GATED: up's row j is weight row N + j (unused otherwise)
        products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        up_products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K_SLICE, BLOCK_K, num_stages=STAGES):  # K constexpr: one compile per layer shape
            cols_k = pid_s * K_SLICE + k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + cols_k[None, :], mask=row_ok[:, None], other=0.0)
            x = x.to(tl.float32)[:, None, :]
            w = tl.load(w_rows + cols_k[None, :], mask=n_ok[:, None], other=0.0)
            products += x * w.to(tl.float32)[None, :, :]
            if GATED:
                u = tl.load(up_rows + cols_k[None, :], mask=n_ok[:, None], other=0.0)
                up_products += x * u.to(tl.float32)[None, :, :]
        y = tl.sum(products, axis=2)
        offsets = rows[:, None] * N + cols_n[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                y += tl.load(b_ptr + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                u = tl.sum(up_products, axis=2)
                if HAS_BIAS:
                    u += tl.load(b_ptr + N + cols_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                y = _silu_times(to_bf16(y).to(tl.float32), to_bf16(u).to(tl.float32))
            tl.store(out_ptr + offsets, to_bf16(y), mask=mask)
        else:  # fp32 partials (SPLIT, M, N) (gated: (SPLIT, 2, M, N)), summed by _sum_splits_kernel
            part = out_ptr + pid_s * M * N * (2 if GATED else 1)
            tl.store(part + offsets, y, mask=mask)
            if GATED:
                tl.store(part + M * N + offsets, tl.sum(up_products, axis=2), mask=mask)

    @triton.jit
    def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                           SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < M * N
        stride = M * N * (2 if GATED else 1)
        y = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: the same sum every call
            y += tl.load(part_ptr + s * stride + offsets, mask=ok, other=0.0)
            if GATED:
                u += tl.load(part_ptr + s * stride + M * N + offsets, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + offsets % N, mask=ok, other=0.0).to(tl.float32)
            if GATED:
                u += tl.load(b_ptr + N + offsets % N, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            y = _silu_times(to_bf16(y).to(tl.float32), to_bf16(u).to(tl.float32))
        tl.store(out_ptr + offsets, to_bf16(y), mask=ok)

    def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config,
               gated: bool = False) -> torch.Tensor:
        """The kernel(s) at an explicit ``config`` (the bench tries several; ``fit`` it first); x (M, K)
        contiguous; (M, N) out, N = weight rows (half of them when ``gated``)."""
        (m, k), n = x.shape, weight.shape[0] // (2 if gated else 1)
        bn, bk, split, warps, stages = config
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        target = out if split == 1 else torch.empty((split, 2 if gated else 1, m, n), device=x.device,
                                                    dtype=torch.float32)
        has_bias = bias is not None
        bias_arg = bias if has_bias else weight  # any pointer: not read without HAS_BIAS
        fp8_gemv._traced(_gemv_kernel)[(triton.cdiv(n, bn), split)](
            x, weight, bias_arg, target, m, n, k, k // split, HAS_BIAS=has_bias, GATED=gated, SPLIT=split,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps)
        if split > 1:
            fp8_gemv._traced(_sum_splits_kernel)[(triton.cdiv(m * n, 1024),)](
                target, bias_arg, out, m, n, HAS_BIAS=has_bias, GATED=gated, SPLIT=split, BLOCK=1024, num_warps=4)
        return out

    def _checked(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
        if x.dtype not in DTYPES or weight.dtype != x.dtype or x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"gemv takes (M, K) {DTYPES} rows and a weight of their dtype and K, got "
                             f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
        if gated and weight.shape[0] % 2:
            raise ValueError(f"gated gemv: weight of {weight.shape[0]} rows is not [gate | up]")
        return x.contiguous()

    @torch.library.triton_op("mmtrain::gemv", mutates_args=())
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for M <= MAX_ROWS bf16 rows (``supported``): (M, N)."""
        x = _checked(x, weight, False)
        return launch(x, weight, bias, config_for(x.shape[0], weight.shape[0], x.shape[1]))

    @torch.library.triton_op("mmtrain::gated_gemv", mutates_args=())
    def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up] = F.linear(x, weight, bias)``: (M, N / 2)."""
        x = _checked(x, weight, True)
        return launch(x, weight, bias, config_for(x.shape[0], weight.shape[0] // 2, x.shape[1], True), True)
