"""One attention call, forward + backward, at the Llama-3.2-1B head shapes (32 heads, 8 KV heads, head dim 64)
with packed documents of 100-1,200 tokens: causal SDPA without a mask (the unmasked baseline), the dense-mask
SDPA (the old path), mmtrain's FlexAttention block mask (compiled; the mask build timed separately, it runs
once per micro-batch for all layers) and ``torch.nn.attention.varlen.varlen_attn`` (cu_seqlens; no GQA: K/V
are expanded to 32 heads beforehand, outside the timing), and the flex block mask of a sliding window
(``--window``, Mistral's) intersected with the documents and on its own (one document per row); and the same block
mask run by FlexAttention's FLASH backend (flash-attn-4's CuTe kernels: ``train.document_attention=flex_flash``)
where flash-attn-4 is installed and the GPU is a Hopper or later, and that backend's plain causal attention (the
causal block mask, no documents) beside SDPA's causal kernel (cuDNN's or flash's, the unpacked rows' attention).
One table, median of ``--iters`` timed calls.

    python bench/attention_packed.py [--shapes 4x4096 1x16384 1x32768] [--dtype bf16] [--no-dense] [--window 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmtrain.model.attention import FlexDocuments, dense_document_mask  # noqa: E402
from mmtrain.utils.optional import flash_available  # noqa: E402


def _doc_ids(B: int, S: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        pos, d = 0, 0
        while pos < S:
            n = int(torch.randint(100, 1201, (1,), generator=g))
            ids[b, pos:pos + n] = d
            pos, d = pos + n, d + 1
    return ids


def _time(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4x4096", "1x16384"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense-mask row (S×S memory)")
    ap.add_argument("--window", type=int, default=512, help="sliding window of the window columns (keys per query)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    H, KV, D = a.heads, a.kv_heads, a.head_dim
    print(f"| shape | causal SDPA, no mask | flex FLASH causal, no mask | dense-mask SDPA | flex block mask "
          f"| flex FLASH backend | flex mask build | varlen_attn | flex window {a.window} ∩ documents "
          f"| flex window {a.window}, one document | attention left by the documents |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    flex = FlexDocuments()
    flash = None
    if dev.type != "cuda" or torch.cuda.get_device_capability()[0] < 9 or not flash_available():
        print("(flex FLASH backend not measured: it needs flash-attn-4 and a Hopper or later GPU)")
    else:
        flash = FlexDocuments(backend="FLASH")
    for shape in a.shapes:
        B, S = (int(x) for x in shape.split("x"))
        ids = _doc_ids(B, S).to(dev)
        q = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, KV, S, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
        grad = torch.randn(B, H, S, D, device=dev, dtype=dtype)

        def step(run):
            return lambda: run().backward(grad)
        causal = _time(step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
                       a.iters, sync)
        dense = float("nan")
        if not a.no_dense:
            mask = dense_document_mask(ids, ids, 0)
            dense = _time(step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                          a.iters, sync)
            del mask
        build = _time(lambda: flex.mask(ids, ids, 0), a.iters, sync)
        block_mask = flex.mask(ids, ids, 0)
        flexed = (_time(step(lambda: flex.attend(q, k, v, block_mask, None)), a.iters, sync)
                  if dev.type == "cuda" else float("nan"))  # CPU flex has no backward
        flashed = flash_causal = float("nan")
        if flash is not None:
            try:
                flashed = _time(step(lambda: flash.attend(q, k, v, block_mask, None)), a.iters, sync)
                causal_mask = flash.causal_mask(S, S, 0, None, dev)
                flash_causal = _time(step(lambda: flash.attend(q, k, v, causal_mask, None)), a.iters, sync)
            except Exception as exc:  # noqa: BLE001 - an experimental backend: say why the cell is empty
                print(f"(flex FLASH backend failed at {shape}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        windowed = {}
        for name, row_ids in (("documents", ids), ("one document", torch.zeros_like(ids))):
            window_mask = flex.mask(row_ids, row_ids, 0, a.window)
            windowed[name] = (_time(step(lambda m=window_mask: flex.attend(q, k, v, m, None)), a.iters, sync)
                              if dev.type == "cuda" else float("nan"))
        varlen = float("nan")
        try:
            from torch.nn.attention.varlen import varlen_attn

            lengths = torch.cat([torch.bincount(row)[torch.bincount(row) > 0] for row in ids.cpu()])
            cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]).to(dev)
            qt = q.detach().transpose(1, 2).reshape(B * S, H, D).requires_grad_()
            kt, vt = (t.detach().repeat_interleave(H // KV, dim=1).transpose(1, 2).reshape(B * S, H, D)
                      .requires_grad_() for t in (k, v))
            gt = grad.transpose(1, 2).reshape(B * S, H, D)
            mx = int(lengths.max())
            varlen = _time(lambda: varlen_attn(qt, kt, vt, cu, cu, mx, mx).backward(gt), a.iters, sync)
        except Exception as exc:  # noqa: BLE001 - the row is optional: say why it is missing
            print(f"(varlen_attn not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
        counts = torch.stack([torch.bincount(row, minlength=S) for row in ids.cpu()]).double()
        left = float((counts ** 2).sum() / (B * S * S))
        print(f"| {shape} | {causal:.2f} ms | {flash_causal:.2f} ms | {dense:.2f} ms | {flexed:.2f} ms "
              f"| {flashed:.2f} ms | {build:.2f} ms "
              f"| {varlen:.2f} ms "
              f"| {windowed['documents']:.2f} ms | {windowed['one document']:.2f} ms | {left:.3f} |", flush=True)


if __name__ == "__main__":
    main()
