"""Accuracy and decode speed of a checkpoint beside its quantized folders, one table (issue #34, part 2).

    python bench/quant_accuracy.py --ckpt CKPT --folders fp8=DIR w4a16-rtn=DIR w4a16-gptq=DIR --data PREFIX
                                   [--max-samples 256] [--batch 1] [--prompt 128] [--new 256] [--no-compile]
                                   [--device cuda] [--output F.json]

Per model (the checkpoint as ``bf16``, then each folder): held-out perplexity through the product's evaluation
(``python -m mmtrain.evaluate --ckpt X --data PREFIX --split valid --max-samples N``, a subprocess: the checkpoint's
own data split, so the validation documents are not the ones GPTQ calibrated on, which come from the train split),
and batch-``--batch`` decode speed with ``bench/generate.py``'s timing (random 128-token prompts, 256 new tokens,
warmed up at the timed shapes, compiled with CUDA graphs unless ``--no-compile``) on the model
``mmtrain.generate`` loads (``load_checkpoint_model``: QuantizedLinear with ``torch._scaled_mm`` for FP8, tinygemm
for int4 on a GPU). Prints one JSON line per model, then the table: perplexity, its change against bf16, new
tokens/s and the speed-up against bf16. ``--device cpu --no-compile`` with tiny inputs checks the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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


def perplexity(ckpt: str, data: str, max_samples: int, device: str) -> dict:
    """``python -m mmtrain.evaluate`` on the valid split: {"loss", "perplexity", "tokens"} (or {"error"})."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "eval.json"
        proc = subprocess.run([sys.executable, "-m", "mmtrain.evaluate", "--ckpt", ckpt, "--data", data,
                               "--split", "valid", "--max-samples", str(max_samples), "--device", device,
                               "--output", str(report)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        found = json.loads(report.read_text())
    return {k: found[k] for k in ("loss", "perplexity", "tokens")}


def decode_speed(ckpt: str, device: torch.device, batch: int, prompt: int, new: int, compile: bool) -> dict:
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
    row = time_generation(model, batch, prompt, new, compile, device)
    del model
    return {k: row[k] for k in ("tokens_per_s", "ms_per_step", "peak_mem_gib")}


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
    ap.add_argument("--output", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    device = torch.device(a.device)
    models = [("bf16" if device.type == "cuda" else "dense", a.ckpt)] + [tuple(f.split("=", 1)) for f in a.folders]
    rows = []
    for name, path in models:
        row = {"model": name, "path": path, **perplexity(path, a.data, a.max_samples, a.device)}
        try:
            row.update(decode_speed(path, device, a.batch, a.prompt, a.new, not a.no_compile))
        except Exception as exc:  # noqa: BLE001 - one failing model costs only its own line
            row["decode_error"] = repr(exc)[:300]
        rows.append(row)
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
        Path(a.output).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
