"""Accuracy and decode speed of a checkpoint beside its quantized folders, one table (issue #34, part 2).

    python bench/quant_accuracy.py --ckpt CKPT --folders fp8=DIR w4a16-rtn=DIR w4a16-gptq=DIR --data PREFIX
                                   [--max-samples 256] [--data-split 96,3,1] [--precision bf16] [--batch 1]
                                   [--prompt 128] [--new 256] [--no-compile] [--decode parallel|serial]
                                   [--device cuda] [--output F.json]

Per model (the checkpoint as ``bf16``, then each folder): held-out perplexity through the product's evaluation
(``python -m mmtrain.evaluate --ckpt X --data PREFIX --split valid --max-samples N``, one subprocess per model, all
at once: the checkpoint's own data split unless ``--data-split``, so the validation documents are not the ones GPTQ
calibrated on, which come from the train split), then batch-``--batch`` decode speed with ``bench/generate.py``'s
timing (random 128-token prompts, 256 new tokens, warmed up at the timed shapes, compiled with CUDA graphs unless
``--no-compile``) on the model ``mmtrain.generate`` loads (``load_checkpoint_model``: QuantizedLinear with
``torch._scaled_mm`` for FP8, tinygemm for int4 on a GPU). ``--decode parallel`` (default) loads and compiles every
model at once, one process each, then times them one at a time while the others wait idle: the compiles overlap,
the timings do not. Prints one JSON line per model, then the table: perplexity, its change against bf16, new
tokens/s and the speed-up against bf16. ``--device cpu --no-compile`` with tiny inputs checks the script.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from generate import time_generation  # noqa: E402  (bench/generate.py)

from mmtrain.inference.loading import load_checkpoint_model  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed  # noqa: E402
from mmtrain.utils.atomic import atomic_write_text  # noqa: E402


def _evaluate_command(ckpt: str, a: argparse.Namespace, report: Path) -> list[str]:
    cmd = [sys.executable, "-m", "mmtrain.evaluate", "--ckpt", ckpt, "--data", a.data, "--split", "valid",
           "--max-samples", str(a.max_samples), "--device", a.device, "--output", str(report)]
    cmd += ["--data-split", a.data_split] if a.data_split else []
    return cmd + (["--precision", a.precision] if a.precision else [])


def perplexities(models: list[tuple[str, str]], a: argparse.Namespace) -> dict[str, dict]:
    """``python -m mmtrain.evaluate`` on the valid split of every model, all at once (untimed: nothing else runs
    meanwhile): name -> {"loss", "perplexity", "tokens"} (or {"error"})."""
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, (name, path) in enumerate(models):
            report = Path(tmp) / f"eval{i}.json"
            procs.append((name, report, subprocess.Popen(
                _evaluate_command(path, a, report), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})))
        for name, report, proc in procs:
            _, err = proc.communicate()
            if proc.returncode != 0 or not report.is_file():
                found[name] = {"error": (err.strip().splitlines() or ["?"])[-1][:300]}
                continue
            row = json.loads(report.read_text())
            found[name] = {k: row[k] for k in ("loss", "perplexity", "tokens")}
    return found


def decode_speed(ckpt: str, device: torch.device, batch: int, prompt: int, new: int, compile: bool,
                 before_timing=None) -> dict:
    """Batch-``batch`` generation speed of the model ``mmtrain.generate`` loads from ``ckpt`` (bf16 on a GPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    init_distributed(device=device)
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1, tp=1).build(), device, dtype)
    finally:
        shutdown_distributed()
    row = time_generation(model, batch, prompt, new, compile, device, before_timing=before_timing)
    del model
    return {k: row[k] for k in ("tokens_per_s", "ms_per_step", "warmup_s", "peak_mem_gib")}


def _decode_worker(path: str, device: str, batch: int, prompt: int, new: int, compile: bool, ready, turn,
                   results) -> None:
    """One model's decode timing in its own process: load and warm up (compile) at once with the others, then
    wait for ``turn`` so that the timed run has the GPU alone."""
    def wait_for_turn() -> None:
        ready.set()
        turn.wait()
    try:
        results.put(decode_speed(path, torch.device(device), batch, prompt, new, compile, wait_for_turn))
    except Exception as exc:  # noqa: BLE001 - one failing model costs only its own line
        results.put({"decode_error": repr(exc)[:300]})
    finally:
        ready.set()  # a worker that failed before its turn must not hold the others up


def decode_speeds(models: list[tuple[str, str]], a: argparse.Namespace) -> dict[str, dict]:
    """Every model's decode speed. ``--decode serial``: one after the other in this process. ``parallel``: one
    process per model; all load and compile at once (the compile is CPU work), then each is timed alone, in
    turn, while the others wait idle (their CUDA graphs captured, nothing running)."""
    if a.decode == "serial":
        found = {}
        for name, path in models:
            try:
                found[name] = decode_speed(path, torch.device(a.device), a.batch, a.prompt, a.new, not a.no_compile)
            except Exception as exc:  # noqa: BLE001 - one failing model costs only its own line
                found[name] = {"decode_error": repr(exc)[:300]}
        return found
    ctx = mp.get_context("spawn")
    workers = []
    for name, path in models:
        ready, turn, results = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_decode_worker, args=(path, a.device, a.batch, a.prompt, a.new,
                                                        not a.no_compile, ready, turn, results))
        proc.start()
        workers.append((name, proc, ready, turn, results))
    for name, proc, ready, _, _ in workers:
        while not ready.wait(1.0) and proc.is_alive():
            pass
    found = {}
    for name, proc, _, turn, results in workers:
        turn.set()
        try:
            found[name] = results.get(timeout=a.turn_timeout)
        except queue.Empty:
            found[name] = {"decode_error": f"no result within {a.turn_timeout} s of its turn (exit {proc.exitcode})"}
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="the dense checkpoint (its row is bf16)")
    ap.add_argument("--folders", nargs="+", default=[], help="NAME=FOLDER of each quantized folder")
    ap.add_argument("--data", required=True, help="prepared data (its valid split is the held-out text)")
    ap.add_argument("--max-samples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-split", default=None, help="evaluate's --data-split (default: each checkpoint's own)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="evaluate's --precision")
    ap.add_argument("--decode", choices=("parallel", "serial"), default="parallel",
                    help="parallel: each model's process compiles at once with the others, timed one at a time")
    ap.add_argument("--turn-timeout", type=float, default=120.0, help="parallel: seconds a timed run may take")
    ap.add_argument("--output", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    device = torch.device(a.device)
    models = [("bf16" if device.type == "cuda" else "dense", a.ckpt)] + [tuple(f.split("=", 1)) for f in a.folders]
    scores = perplexities(models, a)
    for name, _ in models:
        print(json.dumps({"model": name, **scores[name]}), flush=True)
    speeds = decode_speeds(models, a)
    rows = [{"model": name, "path": path, **scores[name], **speeds[name]} for name, path in models]
    for row in rows:
        print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\n| model | perplexity | vs {base['model']} | batch-{a.batch} new tokens/s | vs {base['model']} | "
          "peak GiB |\n|---|---|---|---|---|---|")
    for r in rows:
        ppl = r.get("perplexity")
        dppl = (f"{100 * (ppl / base['perplexity'] - 1):+.2f}%" if ppl and base.get("perplexity")
                and math.isfinite(ppl) else "-")
        tps = r.get("tokens_per_s")
        speed = f"{tps / base['tokens_per_s']:.2f}x" if tps and base.get("tokens_per_s") else "-"
        print(f"| {r['model']} | {f'{ppl:.3f}' if ppl else r.get('error', '-')} | {dppl} | "
              f"{tps or r.get('decode_error', '-')} | {speed} | {r.get('peak_mem_gib', '-')} |")
    if a.output:
        atomic_write_text(a.output, json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
