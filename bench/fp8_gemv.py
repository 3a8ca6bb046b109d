"""The FP8 linear of one decode token at Llama-3.2-1B shapes on the GPU: mmtrain's one-kernel Triton path
(``mmtrain.model.fp8_gemv``) at its table config and at candidate configs, against ``quantize_tokens_fp8`` +
``torch._scaled_mm`` (the path it replaces at M <= 16) and bf16 ``F.linear``.

    python bench/fp8_gemv.py [--reps 100] [--rows 1]

Each variant is captured in a CUDA graph of ``--reps`` calls and replayed (bench/decode_kernels.py's
``graph_time_us``), as the compiled decode step runs. GB/s: the weight's bytes (1 a value for FP8, 2 for bf16)
over the time; the H200's HBM roofline is ~4.8 TB/s. "err": max |y - y_scaled_mm| / max |y_scaled_mm|. The
best config of each shape is marked: copy it into ``fp8_gemv.CONFIGS`` when it is not the table's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_kernels import graph_time_us
from mmtrain.model import fp8_gemv
from mmtrain.model.quantized_linear import quantize_tokens_fp8

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) tried besides the table's
CANDIDATES = {
    "qkv": [(16, 512, 1, 4, 3), (8, 1024, 1, 8, 3), (8, 256, 1, 2, 4)],
    "o": [(8, 512, 1, 4, 3), (8, 1024, 1, 8, 3), (16, 256, 2, 4, 3)],
    "gate_up": [(64, 256, 1, 4, 3), (16, 512, 1, 4, 3), (32, 1024, 1, 8, 3)],
    "down": [(16, 512, 4, 4, 3), (32, 1024, 2, 8, 3), (64, 512, 4, 8, 3)],
}


def shape_rows(name: str, n: int, k: int, m: int, reps: int) -> None:
    """Print the table's rows of one shape: the baselines, the table's config, the candidates."""
    w = torch.randn(n, k, device="cuda") * 0.02
    w_s = w.abs().amax(1, keepdim=True) / 448
    w_q = (w / w_s).to(torch.float8_e4m3fn)
    w_bf16 = w.bfloat16()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def scaled_mm():
        x_q, x_scale = quantize_tokens_fp8(x)
        return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale.float(), scale_b=w_s.t(), out_dtype=x.dtype)

    ref = scaled_mm().float()
    table = fp8_gemv.config_for(m, n, k)
    variants = {"bf16 F.linear": (lambda: F.linear(x, w_bf16), 2),
                "quantize_tokens_fp8 + _scaled_mm": (scaled_mm, 1),
                f"fp8_linear op, table {table}": (lambda: fp8_gemv.fp8_linear(x, w_q, w_s, None), 1)}
    for c in CANDIDATES[name]:
        if c != table:
            variants[f"triton {c}"] = (lambda c=c: fp8_gemv.launch(x, w_q, w_s, None, c), 1)
    rows = []
    for label, (fn, bytes_per) in variants.items():
        try:
            err = float((fn().float() - ref).abs().max() / ref.abs().max())
            us = graph_time_us(fn, reps)
        except Exception as e:  # noqa: BLE001 -- a config that fails to compile is reported, not fatal
            print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows.append((label, us, n * k * bytes_per / us / 1e3, err))
    best = min((r for r in rows if "table" in r[0] or r[0].startswith("triton")), key=lambda r: r[1], default=None)
    for label, us, gbs, err in rows:
        mark = " **best**" if best is not None and label == best[0] else ""
        print(f"| {name} {n}x{k} | {label}{mark} | {us:.2f} | {gbs:.0f} | {err:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1, help="tokens per call (M)")
    a = ap.parse_args()
    start = time.time()
    torch.manual_seed(0)
    print(f"| linear (M={a.rows}) | variant | us | GB/s | err |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        shape_rows(name, n, k, a.rows, a.reps)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
