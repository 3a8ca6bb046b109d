"""Packed documents vs unmasked causal attention on real prepped tokens (issue 18): one table.

    python3 bench/packed_h200.py --data PREFIX [--only NAME ...] [--steps 8] [--warmup 3]   (bench/h200_packed.sh)

Each row is one ``bench/train_gpt.py`` process on the same data, compiled bf16 (or FP8) Llama-3.2-1B shapes:
"unmasked" trains on the packed tokens with plain causal attention (as every earlier benchmark did), "packed"
with the packed-document keys (attention inside documents, FlexAttention block masks). The ratio is packed /
unmasked tokens/s of the same shape and precision, against the issue's targets. TFLOP/s: the standard figure
(6N + causal attention) and, for packed rows, the FLOPs actually done under the document mask. The table is
printed after every row and written to ``$OUT/packed_h200.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.utils.atomic import atomic_write_text  # noqa: E402

COMMON = ["train.compile=true", "optim.master_weights=false"]
FP8 = ["train.precision=fp8", "fp8.backend=native", "fp8.recipe=delayed", "fp8.output_layer=true"]
# (name, batch, seq, overrides, packed); each packed row's ratio is against the unmasked row of its shape
ROWS = [
    ("bf16 4x4096", 4, 4096, [], False), ("bf16 4x4096 packed", 4, 4096, [], True),
    ("bf16 1x16384", 1, 16384, [], False), ("bf16 1x16384 packed", 1, 16384, [], True),
    ("bf16 1x32768", 1, 32768, [], False), ("bf16 1x32768 packed", 1, 32768, [], True),
    ("fp8 4x4096", 4, 4096, FP8, False), ("fp8 4x4096 packed", 4, 4096, FP8, True),
]
TARGETS = {"bf16 4x4096 packed": 1.05, "bf16 1x16384 packed": 1.3, "bf16 1x32768 packed": 1.5,
           "fp8 4x4096 packed": 1.05}


def table(results: dict[str, dict]) -> str:
    lines = ["| row | tokens/s | ratio (target) | model TFLOP/s | MFU | TFLOP/s done under the mask | attention left "
             "| tokens per document piece | peak GiB | loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, *_ in ROWS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |||||||||")
            continue
        ratio = ""
        base = results.get(name.replace(" packed", ""))
        if name in TARGETS and base and "tokens_per_s" in base:
            x = r["tokens_per_s"] / base["tokens_per_s"]
            ratio = f"{x:.2f}x (>= {TARGETS[name]}: {'met' if x >= TARGETS[name] else 'NOT met'})"
        done = f"{r['doc_tflops']} ({r['doc_mfu']:.3f})" if "doc_tflops" in r else ""
        left = f"{r['doc_attention_fraction']:.3f}" if "doc_attention_fraction" in r else ""
        mean_doc = r.get("mean_doc_tokens", "")
        lines.append(f"| {name} | {r['tokens_per_s']:,} | {ratio} | {r['model_tflops']} | {r['mfu']:.3f} | {done} "
                     f"| {left} | {mean_doc} | {r['peak_mem_gib']} | {r['loss']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="indexed-dataset prefix (mmtrain-prep text --append-eod)")
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--only", nargs="*", help="row names to run (default: all)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per row")
    ap.add_argument("--seq-scale", type=int, default=1, help="divide every sequence length by this (CPU checks)")
    ap.add_argument("extra", nargs="*", help="overrides for every row (e.g. train.device=cpu on a CPU check)")
    a = ap.parse_args()
    results: dict[str, dict] = {}
    out = Path(os.environ["OUT"]) / "packed_h200.md" if os.environ.get("OUT") else None
    common = [o for o in COMMON if not any(e.split("=")[0] == o.split("=")[0] for e in a.extra)]
    for name, batch, seq, overrides, packed in ROWS:
        if a.only and name not in a.only:
            continue
        cmd = [sys.executable, str(REPO / "bench/train_gpt.py"), "--model", a.model, "--data", a.data,
               "--batch", str(batch), "--seq", str(seq // a.seq_scale), "--steps", str(a.steps),
               "--warmup", str(a.warmup), "--label", name, *(["--packed"] if packed else []),
               *common, *overrides, *a.extra]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            if rows:
                results[name] = rows[-1]
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results[name] = {"error": f"rc {proc.returncode}: {tail[:160]}"}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"over {a.timeout:.0f} s"}
        print(f"### {name}: {json.dumps(results[name])}", flush=True)
        text = table(results)
        print(text, flush=True)
        if out is not None:
            atomic_write_text(out, text + "\n")


if __name__ == "__main__":
    main()
