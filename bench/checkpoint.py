"""Checkpoint save/load throughput and async-save overhead for the Llama-3.2-1B shapes on one GPU.

    python bench/checkpoint.py [--dir /tmp/mmtrain-ckpt-bench] [key=value ...]

Trains 2 steps (so the optimizer state exists), then times: a synchronous save (GB/s of bytes written), an
asynchronous save (how long the step waits vs the background write), and a load (GB/s). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device  # noqa: E402
from mmtrain.train.checkpoint import CheckpointWriter, load_checkpoint  # noqa: E402
from mmtrain.train.loop import train_gpt  # noqa: E402


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/mmtrain-ckpt-bench")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    cfg = load_config(GPTRunConfig, REPO / "configs/models/llama3.2-1b.yaml", [
        "data.mock=true", "data.seq_length=1024", "train.micro_batch_size=1", "train.steps=2", "train.precision=bf16",
        f"logging.run_dir={root / 'run'}", "checkpoint.save_final=false", *a.overrides])
    device = pick_device(cfg.train.device)
    init_distributed("auto", device)
    mesh = ParallelDims.from_config(cfg.parallel, 1).build()
    captured = {}
    import mmtrain.train.loop as loop
    real_opt = loop.MixedPrecisionAdamW

    def keep_opt(*args, **kw):  # keep the loop's optimizer (with its state) for the timings below
        captured["opt"] = real_opt(*args, **kw)
        return captured["opt"]
    loop.MixedPrecisionAdamW = keep_opt
    result = train_gpt(cfg, mesh, device)
    model, opt = result.model, captured["opt"]
    loader = {"consumed_samples": 2}
    sync = CheckpointWriter(root / "sync", mesh)
    t = time.perf_counter()
    folder = sync.save(2, model, opt, loader, device)
    save_s = time.perf_counter() - t
    size = _bytes(folder)
    async_writer = CheckpointWriter(root / "async", mesh, async_save=True)
    t = time.perf_counter()
    async_writer.save(2, model, opt, loader, device)
    blocked_s = time.perf_counter() - t
    async_writer.wait()
    async_total_s = time.perf_counter() - t
    torch.cuda.synchronize() if device.type == "cuda" else None
    t = time.perf_counter()
    load_checkpoint(folder, mesh, model, opt, device)
    torch.cuda.synchronize() if device.type == "cuda" else None
    load_s = time.perf_counter() - t
    step_ms = 1000 * sorted(result.step_times)[len(result.step_times) // 2]
    print(json.dumps({"checkpoint_gb": round(size / 1e9, 2), "sync_save_s": round(save_s, 2),
                      "save_gb_per_s": round(size / 1e9 / save_s, 2), "async_step_wait_s": round(blocked_s, 3),
                      "async_background_s": round(async_total_s, 2), "load_s": round(load_s, 2),
                      "load_gb_per_s": round(size / 1e9 / load_s, 2), "train_step_ms": round(step_ms, 1)}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
