"""The pieces of a batch-1 decode step at Llama-3.2-1B shapes, each timed alone on the GPU: the matmuls of one
token (M = 1) and the attention of one query over the cache, in the ways torch can run them. For issue #19's
batch-1 goal: which of them to use in the compiled decode step.

    python bench/decode_kernels.py [--cache 392] [--reps 200]

Each variant is captured in a CUDA graph of ``--reps`` calls and the graph is replayed and timed, so launch
overhead is out of the figure (the decode step runs as CUDA graphs too). Matmuls: the weights' bytes over the time
(the HBM roofline is ~4.2 TB/s). Attention: 32 query heads over 8 KV heads of 64, one query at a position near
the end of a cache of ``--cache`` positions, keys beyond it masked (as ``mmtrain.inference.decoder`` does).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmtrain.inference.sampling import argmax_rows  # noqa: E402

LINEARS = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "head": (128256, 2048)}


def graph_time_us(fn, reps: int) -> float:
    """Microseconds per call of ``fn`` replayed from one CUDA graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def split_k_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ w.T as ``splits`` bf16 partial products over slices of K (a batched matmul: more thread blocks at
    M = 1), then their sum."""
    N, K = w_NK.shape
    w = w_NK.view(N, splits, K // splits).permute(1, 2, 0)  # (splits, K/splits, N), no copy
    return torch.bmm(x_MK.view(-1, splits, K // splits).transpose(0, 1), w).sum(0)


def split_k_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, splits: int) -> torch.Tensor:
    """As ``split_k_linear`` with fp32 partials (one rounding at the end): the down projection's decode path of
    sessions 9-22 (``SplitKLinear``, replaced by ``mmtrain.model.gemv`` in session 23)."""
    (n, k), m = w_NK.shape, x_MK.shape[0]
    w = w_NK.view(n, splits, k // splits).permute(1, 2, 0)
    return torch.bmm(x_MK.reshape(m, splits, k // splits).transpose(0, 1), w, out_dtype=torch.float32).sum(0)


def linear_rows(reps: int, shapes: dict, m: int = 1, full: bool = True) -> list[tuple[str, str, float, float]]:
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        variants = {"F.linear": lambda: F.linear(x, w)}
        for s in (2, 4, 8) if full else (8,):
            variants[f"split-K {s}"] = lambda s=s: split_k_linear(x, w, s)
        variants["split-K 8, fp32 partials (mmtrain until s22)"] = lambda: split_k_matmul(x, w, 8).to(x.dtype)
        variants["split-K 8, fp32 partials, compiled"] = torch.compile(lambda: split_k_matmul(x, w, 8).to(x.dtype))
        if full:
            compiled = torch.compile(lambda: F.linear(x, w), options={"coordinate_descent_tuning": True})
            variants["compiled, coordinate descent"] = compiled
        ref = F.linear(x, w).float()
        for label, fn in variants.items():
            try:
                err = float((fn().float() - ref).abs().max() / ref.abs().max())
                us = graph_time_us(fn, reps)
            except Exception as e:  # noqa: BLE001 -- a variant torch cannot run here is reported, not fatal
                rows.append((name, label, float("nan"), float("nan")))
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append((f"{name} (M={m})", label, us, n * k * 2 / us / 1e6))
            if err > 2e-2:
                print(f"{name} {label}: relative error {err:.1e}")
    return rows


def attention_rows(cache: int, reps: int) -> list[tuple[str, float]]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    B, Hq, Hkv, D = 1, 32, 8, 64
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, cache, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.full((B, 1), cache - 40, device="cuda")
    key_index = torch.arange(cache, device="cuda")

    def mask():
        return key_index[None, None, None, :] <= pos[:, None, :, None]

    def sdpa(backend=None):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), enable_gqa=True)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), enable_gqa=True)

    def math_gqa():
        qg = q.view(B, Hkv, Hq // Hkv, D)
        s = torch.matmul(qg, k.transpose(-1, -2)).float() / math.sqrt(D)
        s = s.masked_fill(~(key_index <= pos[:, :, None, None]), float("-inf"))
        return torch.matmul(s.softmax(-1).to(v.dtype), v).view(B, Hq, 1, D)

    block = 128
    blocks = -(-cache // block)
    kv_num = torch.full((B, 1, 1), blocks, device="cuda", dtype=torch.int32)
    kv_idx = torch.arange(blocks, device="cuda", dtype=torch.int32).view(1, 1, 1, blocks)

    def visible(b, h, q_idx, kv):
        return kv <= pos[b, 0]

    # every block partial (none "full"): the mask function runs on every key, so its positions may change
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, None, None, BLOCK_SIZE=(block, block), mask_mod=visible,
                                  seq_lengths=(1, cache))
    flex = torch.compile(lambda: flex_attention(q, k, v, block_mask=bm, enable_gqa=True), dynamic=False)
    ref = sdpa(SDPBackend.MATH).float()
    variants = {"SDPA default (bool mask)": sdpa,
                "SDPA cuDNN": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
                "SDPA efficient": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION),
                "SDPA math": lambda: sdpa(SDPBackend.MATH),
                "math GQA, compiled": torch.compile(math_gqa, dynamic=False),
                "flex_attention (decode kernel), compiled": flex}
    rows = []
    for label, fn in variants.items():
        try:
            err = float((fn().float() - ref).abs().max())
            rows.append((label, graph_time_us(fn, reps), err))
        except Exception as e:  # noqa: BLE001
            print(f"{label}: {type(e).__name__}: {str(e)[:160]}")
            rows.append((label, float("nan"), float("nan")))
    return rows


def argmax_rows_us(reps: int) -> list[tuple[str, float]]:
    logits = torch.randn(1, 128256, device="cuda")
    variants = {"argmax": lambda: logits.argmax(-1), "argmax_rows (two passes)": lambda: argmax_rows(logits),
                "argmax, compiled": torch.compile(lambda: logits.argmax(-1)),
                "argmax_rows, compiled": torch.compile(lambda: argmax_rows(logits))}
    return [(label, graph_time_us(fn, reps)) for label, fn in variants.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=int, default=392, help="cache positions (bench/generate.py: 128 + 256 + 8)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="only the down projection, the argmax")
    a = ap.parse_args()
    torch.manual_seed(0)
    print("| matmul (M=1) | variant | us | TB/s |\n|---|---|---|---|")
    rows = linear_rows(a.reps, LINEARS) if not a.quick else []
    rows += linear_rows(a.reps, {"down": LINEARS["down"]}, 1, full=False)
    rows += linear_rows(a.reps, {"down": LINEARS["down"]}, 4, full=False)
    for name, label, us, tbs in rows:
        print(f"| {name} | {label} | {us:.2f} | {tbs:.2f} |")
    print("\n| argmax over 128256 (fp32, one row) | us |\n|---|---|")
    for label, us in argmax_rows_us(a.reps):
        print(f"| {label} | {us:.2f} |")
    if a.quick:
        return
    print(f"\n| attention, 1 query, cache {a.cache} | us | max abs error |\n|---|---|---|")
    for label, us, err in attention_rows(a.cache, a.reps):
        print(f"| {label} | {us:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
