"""Where a GPT training step's GPU time goes: torch.profiler over a few steps, top kernels by CUDA time.

    python bench/profile_gpt.py [--model ...] [--batch 4] [--seq 4096] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device  # noqa: E402
from mmtrain.train import loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = load_config(GPTRunConfig, a.model, [
        "data.mock=true", f"data.seq_length={a.seq}", f"train.micro_batch_size={a.batch}", "train.steps=6",
        "train.precision=bf16", "logging.run_dir=/tmp/mmtrain-prof", "logging.log_every=1000000", "checkpoint.save_final=false", *a.overrides])
    device = pick_device(cfg.train.device)
    rank, world = init_distributed(cfg.parallel.backend, device)
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    sched = torch.profiler.schedule(wait=3, warmup=1, active=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=sched) as prof:
        original = loop._Run.step

        def stepping(self, step):  # advance the profiler once per optimizer step
            out = original(self, step)
            prof.step()
            return out
        loop._Run.step = stepping
        loop.train_gpt(cfg, mesh, device)
    if rank != 0:
        return
    events = prof.key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
    # time per category over the 2 profiled steps, in ms per step
    cats = {"send/recv (nccl SendRecv: all-to-all, CP ring)": ("sendrecv",), "all_gather (nccl)": ("allgather",),
            "reduce_scatter (nccl)": ("reducescatter",), "all_reduce (nccl)": ("allreduce",),
            "attention kernels": ("sdpa", "flash", "fmha", "attention"), "grouped gemm": ("grouped", "group_gemm")}
    totals = {k: 0.0 for k in cats}
    all_cuda = 0.0
    for e in events:
        t = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        all_cuda += t
        name = e.key.lower()
        for cat, keys in cats.items():
            if any(k in name for k in keys):
                totals[cat] += t
                break
    print(json.dumps({"profile": os.environ.get("PROFILE_LABEL", ""), "gpu_ms_per_step": round(all_cuda / 2e3, 1),
                      **{k: round(v / 2e3, 1) for k, v in totals.items()}}))


if __name__ == "__main__":
    main()
