"""Checkpoint save/load throughput and async-save overhead for the Llama-3.2-1B shapes on one GPU (DCP format).

    python bench/checkpoint.py [--dir /tmp/mmtrain-ckpt-bench] [--steps 30] [--save-every 10] [key=value ...]

1. Trains ``--steps`` steps without checkpoints (baseline step time) and keeps the model and optimizer.
2. Times, on that state: a synchronous save (GB/s of bytes written), a load (GB/s), and one asynchronous save
   of each kind — ``copy`` (our non-blocking copies to pinned memory, then ``dcp.save`` in a thread) and ``dcp``
   (``dcp.async_save``, its own cached pinned staging): how long the caller waits vs the whole write.
3. Trains ``--steps`` steps again with an async save every ``--save-every`` steps, once per kind: the wait per
   save, the median time of the steps that ran while a write was in flight, and the run's extra wall time per
   save compared with the baseline run (the whole cost the training loop sees).
Prints one JSON line. Needs about 2x the checkpoint size (~17 GB with fp32 masters and Adam) of free disk.
With ``--checksums-real`` it first prints the checksum table below for the trained state's own boxes.

    python bench/checkpoint.py --checksums-mb 400 [--repeats 5] [--threads 1]

measures only what checksums cost (any device, CPU included): the same ``--checksums-mb`` of fp32 boxes saved
with and without checksums (``save_chunks(checksums=...)``), alternating, and loaded with and without
verification; prints a table of the median times and the overheads.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device  # noqa: E402
from mmtrain.train import loop  # noqa: E402
from mmtrain.train.checkpoint import CheckpointWriter, load_checkpoint  # noqa: E402


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.distcp"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedWriter(CheckpointWriter):
    """Records how long each ``save`` call held the training loop."""

    waits: ClassVar[list[float]] = []
    steps: ClassVar[list[int]] = []

    def save(self, step, *args, **kw):
        t = time.perf_counter()
        out = super().save(step, *args, **kw)
        type(self).waits.append(time.perf_counter() - t)
        type(self).steps.append(step)
        return out


def _train(cfg: GPTRunConfig, mesh, device, writer=CheckpointWriter):
    """train_gpt with the given writer class; returns (result, optimizer, wall seconds)."""
    captured = {}
    real_opt, real_writer = loop.MixedPrecisionAdamW, loop.CheckpointWriter

    def keep_opt(*args, **kw):  # keep the loop's optimizer (with its state) for the timings below
        captured["opt"] = real_opt(*args, **kw)
        return captured["opt"]
    loop.MixedPrecisionAdamW, loop.CheckpointWriter = keep_opt, writer
    try:
        t = time.perf_counter()
        result = loop.train_gpt(cfg, mesh, device)
        _sync(device)
        return result, captured["opt"], time.perf_counter() - t
    finally:
        loop.MixedPrecisionAdamW, loop.CheckpointWriter = real_opt, real_writer


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def checksum_overhead(root: Path, chunks, repeats: int, threads: int, label: str) -> None:
    """Save/load time of ``chunks`` with and without checksums (``checkpoint.verify``); prints a table."""
    from mmtrain.utils.dcp_io import Chunk, load_chunks, save_chunks

    targets = [Chunk(c.key, c.shape, c.offsets, torch.empty_like(c.tensor)) for c in chunks]
    times: dict[str, list[float]] = {"save": [], "save+hash": [], "load": [], "load+verify": []}
    for i in range(repeats):  # alternating, so drifts of the machine hit both alike
        for checksums in ((False, True) if i % 2 == 0 else (True, False)):
            folder = root / f"sums_{checksums}"
            shutil.rmtree(folder, ignore_errors=True)
            times["save+hash" if checksums else "save"].append(_median_s(
                lambda: save_chunks(folder, chunks, no_dist=True, thread_count=threads, checksums=checksums), 1))
        for verify in ((False, True) if i % 2 == 0 else (True, False)):
            times["load+verify" if verify else "load"].append(_median_s(
                lambda: load_chunks(root / "sums_True", targets, verify=verify), 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = sum(c.tensor.numel() * c.tensor.element_size() for c in chunks) / 1e9
    print(f"checkpoint checksums ({label}): {gb:.2f} GB in {len(chunks)} boxes, {threads} writer thread(s), "
          f"median of {repeats}")
    print(f"{'':14}{'without':>10}{'with':>10}{'overhead':>10}")
    for what, base, with_ in (("save (s)", "save", "save+hash"), ("load (s)", "load", "load+verify")):
        print(f"{what:14}{med[base]:10.3f}{med[with_]:10.3f}{100 * (med[with_] / med[base] - 1):9.1f}%")
    shutil.rmtree(root, ignore_errors=True)


def _random_chunks(mb: int):
    from mmtrain.utils.dcp_io import Chunk

    rows, cols = 4096, 1024  # 16 MiB fp32 boxes, as a rank holds many medium tensors
    n = max(1, mb * 2**20 // (rows * cols * 4))
    return [Chunk(f"w{i}", (rows, cols), (0, 0), torch.randn(rows, cols)) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/mmtrain-ckpt-bench")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="DCP writer threads per rank")
    ap.add_argument("--checksums-mb", type=int, default=0, help="only measure checksums on this many MB")
    ap.add_argument("--repeats", type=int, default=5, help="checksum tables: saves and loads of each kind")
    ap.add_argument("--checksums-real", action="store_true",
                    help="after training, also measure checksums on the trained state's own boxes (the real save)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    if a.checksums_mb:
        checksum_overhead(root, _random_chunks(a.checksums_mb), a.repeats, a.threads, "random fp32 boxes")
        return
    base = ["data.mock=true", "data.seq_length=1024", "train.micro_batch_size=1", "train.precision=bf16",
            "checkpoint.save_final=false", "checkpoint.keep_last=1", f"train.steps={a.steps}", *a.overrides]
    cfg = load_config(GPTRunConfig, REPO / "configs/models/llama3.2-1b.yaml", [*base, f"logging.run_dir={root / 'base'}"])
    device = pick_device(cfg.train.device)
    init_distributed("auto", device)
    mesh = ParallelDims.from_config(cfg.parallel, 1).build()
    out: dict[str, float] = {}

    baseline, opt, base_wall = _train(cfg, mesh, device)
    model = baseline.model
    out["train_step_ms"] = round(1000 * statistics.median(baseline.step_times[2:]), 1)
    loader = {"consumed_samples": a.steps}

    if a.checksums_real:  # the boxes a real save writes (weights, fp32 masters, Adam moments), host copies
        from mmtrain.train.checkpoint_state import save_chunks_of

        chunks, _ = save_chunks_of(mesh, model, opt, device, lambda v: v.detach().to("cpu", copy=True))
        checksum_overhead(root / "sums", chunks, a.repeats, a.threads, "trained Llama-3.2-1B state")
        del chunks

    # 2. one save / load of the trained state
    t = time.perf_counter()
    folder = CheckpointWriter(root / "sync", mesh, thread_count=a.threads).save(a.steps, model, opt, loader, device)
    save_s = time.perf_counter() - t
    size = _bytes(folder)
    _sync(device)
    t = time.perf_counter()
    load_checkpoint(folder, mesh, model, opt, device)
    _sync(device)
    load_s = time.perf_counter() - t
    out.update(checkpoint_gb=round(size / 1e9, 2), sync_save_s=round(save_s, 2),
               save_gb_per_s=round(size / 1e9 / save_s, 2), load_s=round(load_s, 2),
               load_gb_per_s=round(size / 1e9 / load_s, 2))
    shutil.rmtree(root / "sync", ignore_errors=True)
    for via in ("copy", "dcp"):
        writer = CheckpointWriter(root / f"async_{via}", mesh, async_save=True, thread_count=a.threads, async_via=via)
        for i in range(2):  # the second save shows the steady state (pinned buffers cached)
            t = time.perf_counter()
            writer.save(a.steps + i, model, opt, loader, device, keep_last=1)
            waited = time.perf_counter() - t
            writer.wait()
            total = time.perf_counter() - t
        out[f"async_{via}_step_wait_s"] = round(waited, 3)
        out[f"async_{via}_background_s"] = round(total, 2)
        shutil.rmtree(root / f"async_{via}", ignore_errors=True)

    # 3. async saves inside training runs
    del opt
    for via in ("copy", "dcp"):
        _TimedWriter.waits, _TimedWriter.steps = [], []
        run_cfg = load_config(GPTRunConfig, REPO / "configs/models/llama3.2-1b.yaml", [
            *base, f"logging.run_dir={root / via}", "checkpoint.async_save=true", f"checkpoint.save_every={a.save_every}"])
        result, _, wall = _train(run_cfg, mesh, device, functools.partial(_TimedWriter, async_via=via,
                                                                          thread_count=a.threads))
        during = [result.step_times[s] for s in _TimedWriter.steps if s < len(result.step_times)]  # the step after
        out[f"train_{via}_wait_per_save_s"] = round(statistics.median(_TimedWriter.waits), 3)
        out[f"train_{via}_step_ms_during_write"] = round(1000 * statistics.median(during), 1) if during else None
        out[f"train_{via}_extra_wall_per_save_s"] = round((wall - base_wall) / max(len(_TimedWriter.steps), 1), 2)
        del result
        shutil.rmtree(root / via, ignore_errors=True)
    print(json.dumps(out))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
