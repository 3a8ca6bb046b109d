"""GPT training throughput with mmtrain's own engine (mock tokens), one JSON line per run.

    python bench/train_gpt.py [--model configs/models/llama3.2-1b.yaml] [--batch 4] [--seq 4096] [key=value ...]
    torchrun --nproc_per_node 2 bench/train_gpt.py parallel.tp=2 parallel.sequence_parallel=true

Runs the real training loop (``mmtrain.train.loop.train_gpt``) for warmup + timed steps and reports the median
timed step (``logging.log_every=1``: every step is a sync point, so each step's time is its own; with a
longer interval the loop shares the interval's wall time out over its steps, compile steps included): tokens/s per GPU, model TFLOP/s per GPU (6N + causal attention, the anchors' formula), MFU against
the measured H200 bf16 ceiling (736 TFLOP/s), peak memory. Compare with ../shared/bench anchors in the same call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.models.llama.model import flops_per_token  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed  # noqa: E402
from mmtrain.train.loop import train_gpt  # noqa: E402
from mmtrain.utils.log import setup_logging  # noqa: E402

BF16_CEILING_TFLOPS = 736.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size per data-parallel rank")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--label", default="mmtrain")
    ap.add_argument("--print-losses", action="store_true", help="also print every step's loss (parity checks)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(GPTRunConfig, a.model, [
        "data.mock=true", f"data.seq_length={a.seq}", f"train.micro_batch_size={a.batch}",
        f"train.steps={a.steps + a.warmup}", "train.precision=bf16", "optim.warmup_steps=1", "optim.lr=1e-4",
        "logging.run_dir=/tmp/mmtrain-bench", "logging.log_every=1", "checkpoint.save_final=false", *a.overrides])
    validate_gpt_config(cfg, world)
    device = pick_device(cfg.train.device)
    rank, world = init_distributed(cfg.parallel.backend, device)
    setup_logging(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    result = train_gpt(cfg, mesh, device)
    dt = statistics.median(result.step_times[a.warmup:])
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * mesh.dims.dp
    tps = gbs * cfg.data.seq_length / dt / world
    tflops = tps * flops_per_token(cfg.model, cfg.data.seq_length) / 1e12
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    if rank == 0:
        print(json.dumps({"system": a.label, "layout": mesh.dims.describe(), "overrides": a.overrides,
                          "tokens_per_s": round(tps), "step_ms": round(1000 * dt, 1), "model_tflops": round(tflops, 1),
                          "mfu": round(tflops / BF16_CEILING_TFLOPS, 3), "peak_mem_gib": round(mem, 1),
                          "loss": round(result.losses[-1], 4),
                          **({"losses": result.losses} if a.print_losses else {})}), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
