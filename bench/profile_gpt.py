"""Where a GPT training step's GPU time goes: torch.profiler over a few steps, top kernels by CUDA time.

    python bench/profile_gpt.py [--model ...] [--batch 4] [--seq 4096] [key=value ...]
"""

from __future__ import annotations

import argparse
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
        "train.precision=bf16", "logging.run_dir=/tmp/mmtrain-prof", "logging.log_every=1000000", *a.overrides])
    device = pick_device(cfg.train.device)
    init_distributed(cfg.parallel.backend, device)
    mesh = ParallelDims.from_config(cfg.parallel, 1).build()
    sched = torch.profiler.schedule(wait=3, warmup=1, active=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=sched) as prof:
        original = loop.forward_backward

        def stepping(*args, **kw):  # advance the profiler once per training step
            out = original(*args, **kw)
            prof.step()
            return out
        loop.forward_backward = stepping
        loop.train_gpt(cfg, mesh, device)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
