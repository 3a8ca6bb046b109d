"""A decode step's attention per layer, timed alone on the GPU: the unfused step (RoPE on the query and key, the
cache write, the mask and SDPA over the whole cache, compiled by Inductor as the decode step compiles it) against
``mmtrain.model.decode_attention``'s one kernel at each split of the positions and block of keys.

    python bench/decode_attention.py [--reps 200]

Llama-3.2-1B heads (32 query heads over 8 KV heads of 64). Each variant is captured in a CUDA graph of ``--reps``
calls and replayed (bench/decode_kernels.py's ``graph_time_us``), as the decode step runs; the cache rows sit at
the positions named (a short sequence in a long cache reads only its own keys with the kernel). The error column is
the largest difference from the unfused output (bf16 values ~1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_kernels import graph_time_us  # noqa: E402
from mmtrain.model import decode_attention  # noqa: E402
from mmtrain.model.kv_cache import StaticKVCache, cached_attention  # noqa: E402
from mmtrain.model.layers import apply_rope, rope_cos_sin  # noqa: E402

H, KVH, D = 32, 8, 64
# rows, cache positions, where the rows are: the 1B bench's batch-1 step, a long cache barely used and full, a
# server's 32 streams
CASES = [(1, 392, "300"), (1, 4096, "300"), (1, 4096, "4000"), (32, 392, "100-380"), (32, 2048, "100-380"),
         (32, 4096, "3000-4000")]


def positions_for(rows: int, where: str) -> torch.Tensor:
    lo, _, hi = where.partition("-")
    lo, hi = int(lo), int(hi or lo)
    return torch.linspace(lo, hi, rows, device="cuda").long()[:, None]


def unfused_step(q, k, v, cos, sin, cache: StaticKVCache, positions):
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(0, None, positions, k, v)
    keys, values = cache.read(0, None)
    return cached_attention(q, keys, values, cache.key_index, positions)


def rows_for(rows: int, T: int, where: str, reps: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    qkv = torch.randn(rows, 1, (H + 2 * KVH) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(rows, 1, -1, D) for t in qkv.split((H * D, KVH * D, KVH * D), dim=-1))
    positions = positions_for(rows, where)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    cos, sin = rope_cos_sin(positions, inv_freq, torch.bfloat16)
    cache = StaticKVCache(1, rows, KVH, T, D, torch.bfloat16, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    compiled = torch.compile(unfused_step, dynamic=False)
    ref = compiled(q, k, v, cos, sin, cache, positions).float()
    variants = {"unfused (Inductor RoPE + write, SDPA)": lambda: compiled(q, k, v, cos, sin, cache, positions),
                "kernel, its own split": lambda: decode_attention.decode_attention(
                    q, k, v, cos, sin, cache.k[0], cache.v[0], positions)}
    for chunk in (128, 256, 512, 1024, -(-T // 128) * 128):
        for block in (64, 128):
            for stages in (2, 3):
                if chunk >= block and (chunk < T or chunk == -(-T // 128) * 128):
                    variants[f"kernel, {chunk} per program, block {block}, stages {stages}"] = (
                        lambda c=chunk, b=block, s=stages: decode_attention.launch(
                            q, k, v, cos, sin, cache.k[0], cache.v[0], positions, c, block_t=b, stages=s))
    out = []
    for label, fn in variants.items():
        try:
            err = float((fn().float() - ref).abs().max())
            out.append((label, graph_time_us(fn, reps), err))
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end of the table
            out.append((f"{label} ({type(e).__name__}: {str(e)[:80]})", float("nan"), float("nan")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    print(f"### decode attention per layer, {H} query heads over {KVH} KV heads of {D} (us per call)")
    for rows, T, where in CASES:
        results = rows_for(rows, T, where, a.reps)
        base = results[0][1]
        best = min(results[1:], key=lambda r: r[1])
        print(f"\n{rows} rows, cache {T}, positions {where}: unfused {base:.2f} us, own split "
              f"{results[1][1]:.2f} us, best {best[0]} {best[1]:.2f} us")
        print("| variant | us | vs unfused | max error |\n|---|---|---|---|")
        for label, us, err in results:
            print(f"| {label} | {us:.2f} | {base / us:.2f}x | {err:.4f} |")


if __name__ == "__main__":
    main()
