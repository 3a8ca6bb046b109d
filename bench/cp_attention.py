"""Context-parallel attention alone: the K/V all-gather against the ring (``parallel.cp_comm``), one layer's
forward + backward at the 1B shapes, timed, and the ring checked against the all-gather on the same inputs.

    torchrun --nproc_per_node 2 bench/cp_attention.py --seq 32768 65536           # two GPUs (NCCL)
    torchrun --nproc_per_node 2 bench/cp_attention.py --seq 64 --heads 4 --kv-heads 2 --dim 8 --iters 2   # CPU

Per sequence length and documents (none / packed, mean ``--doc-mean`` tokens, crossing the chunk boundaries):
ms per forward+backward of the all-gather and of the ring (median of ``--iters`` after 2 warm-up calls), the
ring's speedup, and the largest difference of the ring's output and Q/K/V gradients from the all-gather's
relative to their scale (bf16 on the GPU: ~1e-2 is rounding; a wrong block shows as O(1)). One table on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmtrain.model.attention_cp import attention_for  # noqa: E402
from mmtrain.parallel.context import shard_sequence  # noqa: E402


def _doc_ids(seq: int, mean: int, g: torch.Generator) -> torch.Tensor:
    starts = (torch.rand(seq, generator=g) < 1.0 / mean).long()
    starts[0] = 0
    return starts.cumsum(0)[None]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(strategy, q, k, v, doc_ids, dout, iters: int, device):
    """(median ms of forward+backward, output, grads); the mask preparation is per micro-batch, not timed."""
    prepared = strategy.prepare(doc_ids)
    times, result = [], None
    for i in range(iters + 2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = strategy(qq, kk, vv, prepared)
        out.backward(dout)
        _sync(device)
        if i >= 2:
            times.append(1000 * (time.perf_counter() - t0))
        result = (out.detach(), qq.grad, kk.grad, vv.grad)
    return statistics.median(times), result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 65536], help="whole-sequence lengths")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--doc-mean", type=int, default=4096, help="mean document length of the packed rows")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for seq in a.seq:
        for docs in (False, True):
            g = torch.Generator().manual_seed(seq)
            full = [torch.randn(1, h, seq, a.dim, generator=g) for h in (a.heads, a.kv_heads, a.kv_heads, a.heads)]
            q, k, v, dout = (shard_sequence(t, cp, rank, dim=2).to(device, dtype) for t in full)
            ids = shard_sequence(_doc_ids(seq, min(a.doc_mean, seq), g), cp, rank).to(device) if docs else None
            ms_gather, ref = _run(attention_for(group, "auto", "allgather"), q, k, v, ids, dout, a.iters, device)
            ms_ring, got = _run(attention_for(group, "auto", "ring"), q, k, v, ids, dout, a.iters, device)
            diff = torch.tensor(max(_rel(x, y) for x, y in zip(got, ref)), device=device)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            rows.append((seq, "packed" if docs else "causal", ms_gather, ms_ring, float(diff)))
    if rank == 0:
        print(f"cp={cp} heads={a.heads}/{a.kv_heads} dim={a.dim} {dtype} {device.type}; ms per forward+backward")
        print(f"{'seq':>7} {'masks':>7} {'allgather':>10} {'ring':>8} {'speedup':>8} {'max rel diff':>13}")
        for seq, masks, ms_g, ms_r, diff in rows:
            print(f"{seq:>7} {masks:>7} {ms_g:>10.2f} {ms_r:>8.2f} {ms_g / ms_r:>7.2f}x {diff:>13.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
