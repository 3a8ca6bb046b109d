"""The FP8 linear of one decode token at Llama-3.2-1B shapes on the GPU: mmtrain's one-kernel Triton path
(``mmtrain.model.fp8_gemv``) at its table config and at candidate configs, against ``quantize_tokens_fp8`` +
``torch._scaled_mm`` (the path it replaces at M <= 16) and bf16 ``F.linear``.

    python bench/fp8_gemv.py [--reps 100] [--rows 1]

Each variant is captured in a CUDA graph of ``--reps`` calls and replayed (bench/decode_kernels.py's
``graph_time_us``), as the compiled decode step runs. GB/s: the weight's bytes (1 a value for FP8, 2 for bf16)
over the time; the H200's HBM roofline is ~4.8 TB/s (~4.2 reached by copies). Weights rotate through copies
that do not fit in L2, as in a decode step. "err": max |y - y_scaled_mm| / max |y_scaled_mm|. The
best config of each shape is marked: copy it into ``fp8_gemv.CONFIGS`` when it is not the table's.
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
from bench.decode_kernels import graph_time_us
from mmtrain.model import fp8_gemv
from mmtrain.model.quantized_linear import quantize_tokens_fp8

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
C = fp8_gemv.Config
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, late_sum) tried besides the table's: session 16's per-step
# reduction, then the late sum (products kept per K in registers, one reduction after the loop) around session
# 17's winners: deeper pipelines, fewer warps, narrower tiles. (Session 17's tensor-core kernel, tl.dot on the FP8
# tile with the tokens padded to 16, measured 3-10x slower, is gone.)
NARROW = [C(8, 512, 1, 4, 4, True), C(8, 512, 1, 2, 3, True), C(8, 256, 1, 2, 3, True), C(8, 1024, 1, 4, 3, True),
          C(16, 512, 1, 8, 3, True), C(16, 256, 1, 4, 3, True)]
CANDIDATES = {
    "qkv": [C(8, 512, 1, 4, 3), *NARROW],
    "o": [C(16, 512, 1, 4, 3), *NARROW],
    "gate_up": [C(32, 512, 1, 4, 3), C(32, 128, 1, 4, 5, True), C(16, 256, 1, 4, 4, True), C(32, 128, 1, 2, 4, True),
                C(64, 128, 1, 4, 4, True), C(32, 256, 1, 4, 4, True), C(32, 256, 1, 4, 3, True)],
    "down": [C(32, 512, 4, 4, 3), C(32, 256, 4, 4, 4, True), C(16, 256, 4, 4, 4, True), C(16, 512, 4, 4, 4, True),
             C(32, 128, 4, 4, 4, True), C(8, 512, 4, 4, 3, True), C(16, 512, 4, 4, 3, True)],
}



def shape_rows(name: str, n: int, k: int, m: int, reps: int) -> fp8_gemv.Config | None:
    """Print the table's rows of one shape: the baselines, the table's config, the candidates; return the fastest
    config whose error is within bf16's (None if none ran). Each call reads
    the next of ``copies`` weights, more bytes in all than the H200's 50 MB L2 holds twice over, as a decode step
    reads each layer's own weights from HBM (one weight replayed 100 times would be served from L2)."""
    copies = max(2, -(-200 * 2**20 // (n * k)))  # FP8 bytes: >= 200 MiB of FP8 weights, 400 MiB of bf16
    w = torch.randn(n, k, device="cuda") * 0.02
    w_s = w.abs().amax(1, keepdim=True) / 448
    w_q = [(w / w_s).to(torch.float8_e4m3fn) for _ in range(copies)]
    w_bf16 = [w.bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    turn = itertools.count()

    def scaled_mm(i=None):
        x_q, x_scale = quantize_tokens_fp8(x)
        weight = w_q[next(turn) % copies if i is None else i]
        return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale.float(), scale_b=w_s.t(), out_dtype=x.dtype)

    ref = scaled_mm(0).float()
    table = fp8_gemv.config_for(m, n, k)
    variants = {"bf16 F.linear": (lambda: F.linear(x, w_bf16[next(turn) % copies]), 2),
                "quantize_tokens_fp8 + _scaled_mm": (scaled_mm, 1),
                f"fp8_linear op, table {tuple(table)}":
                    (lambda: fp8_gemv.fp8_linear(x, w_q[next(turn) % copies], w_s, None), 1)}
    configs = {f"fp8_linear op, table {tuple(table)}": table}  # label -> the Config it ran
    for c in CANDIDATES[name]:
        c = fp8_gemv.fit(c, m, k)
        if c != table:
            label = f"triton {'late sum' if c.late_sum else 'per step'} {tuple(c[:5])}"
            variants[label] = (lambda c=c: fp8_gemv.launch(x, w_q[next(turn) % copies], w_s, None, c), 1)
            configs[label] = c
    rows = []
    for label, (fn, bytes_per) in variants.items():
        try:
            err = float((fn().float() - ref).abs().max() / ref.abs().max())
            us = graph_time_us(fn, reps)
        except Exception as e:  # noqa: BLE001 -- a config that fails to compile is reported, not fatal
            print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows.append((label, us, n * k * bytes_per / us / 1e3, err, configs.get(label)))
    best = min((r for r in rows if r[4] is not None and r[3] < 2e-2), key=lambda r: r[1], default=None)
    for label, us, gbs, err, _ in rows:
        mark = " **best**" if best is not None and label == best[0] else ""
        print(f"| {name} {n}x{k} | {label}{mark} | {us:.2f} | {gbs:.0f} | {err:.1e} |")
    return None if best is None else best[4]


def write_configs(fastest: dict[tuple[int, int], fp8_gemv.Config]) -> None:
    """Replace the entries of ``CONFIGS = {...}`` in mmtrain/model/fp8_gemv.py by ``fastest`` (others kept)
    and print the new block: the bench's choice lands in the source the next run (and the commit) uses."""
    path = Path(fp8_gemv.__file__)
    text = path.read_text()
    start = text.index("CONFIGS = {\n")
    end = text.index("\n}\n", start) + 3
    table = {**fp8_gemv.CONFIGS, **fastest}
    lines = [f"    {nk}: Config{tuple(c)}," for nk, c in table.items()]
    block = "CONFIGS = {\n" + "\n".join(lines) + "\n}\n"
    path.write_text(text[:start] + block + text[end:])
    print(f"\nwrote {path.name}:\n{block}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1, help="tokens per call (M)")
    ap.add_argument("--write-configs", action="store_true",
                    help="write each shape's fastest config into fp8_gemv.CONFIGS (this checkout's source file)")
    a = ap.parse_args()
    start = time.time()
    torch.manual_seed(0)
    print(f"| linear (M={a.rows}) | variant | us | GB/s | err |\n|---|---|---|---|---|")
    fastest = {(n, k): shape_rows(name, n, k, a.rows, a.reps) for name, (n, k) in SHAPES.items()}
    if a.write_configs:
        write_configs({nk: c for nk, c in fastest.items() if c is not None})
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
