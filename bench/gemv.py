"""The bf16 linear of a few decode tokens at Llama-3.2-1B shapes on the GPU: mmtrain's Triton decode kernel
(``mmtrain.model.gemv``) at its table config and at candidate configs, against cuBLAS (``F.linear``), the split-K
batched matmul the down projection took until session 22, and for the MLP's gate|up projection against
``F.linear`` + the SwiGLU kernel (compiled: Inductor's fused activation), which the gated kernel replaces.

    python bench/gemv.py [--reps 100] [--rows 1 2 4 8] [--sweep]

Each variant is captured in a CUDA graph of ``--reps`` calls and replayed (bench/decode_kernels.py's
``graph_time_us``), as the compiled decode step runs. GB/s: the weight's bytes over the time (the H200's HBM
reaches ~4.2 TB/s in copies). Weights rotate through copies that do not fit in L2, as in a decode step. "err":
max |y - y_fp32| / max |y_fp32| (bf16's rounding is ~4e-3). ``--sweep`` (first ``--rows`` value only) also times
the candidate configs and marks each shape's fastest: copy it into ``gemv.CONFIGS`` when it is not the table's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_kernels import graph_time_us, split_k_matmul  # noqa: E402
from mmtrain.model import gemv  # noqa: E402
from mmtrain.model.mlp import swiglu_or_gelu  # noqa: E402

# name -> (weight rows, K, gated); a gated kernel's outputs are half its weight rows
SHAPES = {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate_up": (16384, 2048, True),
          "down": (2048, 8192, False)}
C = gemv.Config
SMALL = [C(4, 512, 1, 4, 3), C(4, 512, 1, 2, 4), C(8, 512, 1, 4, 4), C(8, 256, 1, 4, 4), C(8, 256, 1, 2, 6),
         C(8, 1024, 1, 8, 2), C(4, 1024, 1, 4, 2), C(16, 256, 1, 4, 3), C(16, 512, 1, 8, 3), C(2, 1024, 1, 2, 3),
         C(16, 128, 1, 4, 6), C(8, 128, 1, 2, 8)]
CANDIDATES = {
    "qkv": SMALL,
    "o": SMALL,
    "gate_up": [C(4, 256, 1, 4, 4), C(8, 256, 1, 4, 3), C(8, 256, 1, 4, 5), C(8, 512, 1, 8, 3), C(16, 256, 1, 8, 3),
                C(16, 128, 1, 4, 4), C(4, 512, 1, 4, 3), C(8, 128, 1, 2, 4), C(4, 256, 1, 2, 4), C(16, 256, 1, 8, 4),
                C(32, 128, 1, 8, 4), C(2, 512, 1, 2, 3)],
    "down": [C(8, 512, 1, 4, 4), C(8, 512, 4, 4, 4), C(4, 512, 1, 4, 4), C(4, 1024, 1, 4, 3), C(16, 256, 2, 4, 4),
             C(16, 512, 2, 8, 4), C(8, 256, 2, 4, 4), C(8, 256, 4, 4, 4), C(4, 512, 2, 4, 4), C(16, 512, 4, 8, 3),
             C(8, 1024, 1, 8, 3), C(8, 1024, 2, 8, 3), C(4, 1024, 2, 4, 3)],
}


def shape_rows(name: str, rows_n: int, k: int, gated: bool, m: int, reps: int, sweep: bool) -> None:
    """Print one shape's rows: the baselines, the table's config and (``sweep``) the candidates."""
    copies = max(2, -(-400 * 2**20 // (rows_n * k * 2)))  # >= 400 MiB of weights: each call reads from HBM
    ws = [torch.randn(rows_n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    turn = itertools.count()

    def nxt():
        return ws[next(turn) % copies]

    ref = F.linear(x.float(), ws[0].float())
    if gated:
        ref = swiglu_or_gelu(ref.bfloat16().float(), True)
        swiglu = torch.compile(lambda w: swiglu_or_gelu(F.linear(x, w), True))
        variants = {"F.linear + SwiGLU (compiled)": lambda w=None: swiglu(nxt() if w is None else w)}
    else:
        variants = {"F.linear (cuBLAS)": lambda w=None: F.linear(x, nxt() if w is None else w)}
        if k >= 4 * rows_n:
            split8 = torch.compile(lambda w: split_k_matmul(x, w, 8).to(x.dtype))
            variants["split-K 8 bmm, fp32 partials (until s22)"] = lambda w=None: split8(nxt() if w is None else w)
    n = rows_n // 2 if gated else rows_n
    table = gemv.config_for(m, n, k, gated)
    op = gemv.gated_linear if gated else gemv.linear
    variants[f"gemv op, table {tuple(table)}"] = lambda w=None: op(x, nxt() if w is None else w, None)
    for c in CANDIDATES[name] if sweep else []:
        c = gemv.fit(c, m, k, gated)
        if c != table:
            variants[f"gemv {tuple(c)}"] = lambda w=None, c=c: gemv.launch(x, nxt() if w is None else w, None, c,
                                                                            gated)
    results = []
    for label, fn in variants.items():
        try:
            err = float((fn(ws[0]).float() - ref).abs().max() / ref.abs().max())
            us = graph_time_us(fn, reps)
        except Exception as e:  # noqa: BLE001 -- a config that fails to compile is reported, not fatal
            print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
            continue
        results.append((label, us, err))
    best = min((r for r in results if r[0].startswith("gemv") and r[2] < 2e-2), key=lambda r: r[1], default=None)
    for label, us, err in results:
        mark = " **best gemv**" if best is not None and label == best[0] and sweep else ""
        gbs = rows_n * k * 2 / us / 1e3
        print(f"| {name} {rows_n}x{k} | {m} | {label}{mark} | {us:.2f} | {gbs:.0f} | {err:.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="tokens per call (M), each in turn")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate configs (first --rows value)")
    a = ap.parse_args()
    start = time.time()
    torch.manual_seed(0)
    print("| linear | M | variant | us | GB/s | err |\n|---|---|---|---|---|---|")
    for i, m in enumerate(a.rows):
        for name, (rows_n, k, gated) in SHAPES.items():
            shape_rows(name, rows_n, k, gated, m, a.reps, a.sweep and i == 0)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
