"""The rows and the combined table of bench/h200_after_training.sh (issue #34's GPU figures).

    python bench/after_training_table.py metrics RUN_DIR/metrics.jsonl [k=v ...] --skip 10 --part train --label plain
        one JSON row from a training run's metrics: the median per-step tokens/s and step time of the steps after
        ``--skip`` (the first log interval holds the compile), the peak memory, the last loss; k=v pairs are added
    python bench/after_training_table.py table --rows RES/rows.jsonl [--quant RES/quant_accuracy.json] --out F.md
        the markdown of all parts (each against the issue's goals), printed and written to F.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.utils.atomic import atomic_write_text  # noqa: E402


def metrics_row(path: Path, skip: int, part: str, label: str, extra: list[str]) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r.get("step", 0) > skip and "tokens_per_s" in r] or rows[-1:]
    if not timed:
        raise SystemExit(f"{path}: no metrics rows")
    return {"part": part, "label": label, "steps": rows[-1].get("step"), "timed_steps": len(timed),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed)),
            "step_ms": round(1000 * statistics.median(r["step_time_s"] for r in timed), 1),
            "peak_mem_gib": round(max(r.get("mem_gib", 0.0) for r in rows), 1),
            "last_loss": round(rows[-1].get("loss", float("nan")), 4),
            **dict(kv.split("=", 1) for kv in extra)}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def _goal(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def quant_table(quant: list[dict]) -> list[str]:
    by = {r["model"]: r for r in quant}
    base = quant[0]
    ppl0, tps0 = base.get("perplexity"), base.get("tokens_per_s")

    def dppl(r: dict) -> float | None:
        p = r.get("perplexity")
        return 100 * (p / ppl0 - 1) if p and ppl0 and math.isfinite(p) else None
    goals = {"fp8": lambda r: (dppl(r) is not None and dppl(r) <= 1.0, "ppl <= +1%"),
             "w4a16-gptq": lambda r: (dppl(r) is not None and dppl(r) <= 5.0 and dppl(by.get("w4a16-rtn", {}))
                                      is not None and r["perplexity"] < by["w4a16-rtn"]["perplexity"],
                                      "ppl <= +5% and below RTN's")}
    out = ["| model | perplexity (valid) | vs bf16 | batch-1 new tokens/s | vs bf16 | ms/step | peak GiB | goal |",
           "|---|---|---|---|---|---|---|---|"]
    for r in quant:
        d = dppl(r)
        goal = "-"
        if r["model"] in goals:
            ok, text = goals[r["model"]](r)
            goal = f"{text}: {_goal(ok)}"
        if r["model"] == "fp8":
            fast = isinstance(r.get("tokens_per_s"), (int, float)) and tps0 and r["tokens_per_s"] >= 1.5 * tps0
            goal += f"; decode >= 1.5x bf16: {_goal(bool(fast))}"
        ppl = r.get("perplexity")
        out.append(f"| {r['model']} | {f'{ppl:.3f}' if ppl else r.get('error', '-')} | "
                   f"{'-' if d is None else f'{d:+.2f}%'} | {r.get('tokens_per_s', r.get('decode_error', '-'))} | "
                   f"{_ratio(r.get('tokens_per_s'), tps0)} | {r.get('ms_per_step', '-')} | "
                   f"{r.get('peak_mem_gib', '-')} | {goal} |")
    return out


def table(rows: list[dict], quant: list[dict]) -> str:
    lines = ["## Issue #34 on one H200 (bench/h200_after_training.sh)", ""]
    lines += ["### Post-training quantization (1B shape trained here on .device/data/text)", ""]
    lines += quant_table(quant) if quant else ["(no quantization rows: see the log)"]
    train = next((r for r in rows if r.get("part") == "train"), {})
    distill = [r for r in rows if r.get("part") == "distill"]
    lines += ["", "### Distillation: student tokens/s (1B shape, packed documents, compiled bf16, same loop)", "",
              "| run | teacher | student tokens/s | step ms | peak GiB | vs plain |", "|---|---|---|---|---|---|"]
    for r in ([train] if train else []) + distill:
        lines.append(f"| {r['label']} | {r.get('teacher', '-')} | {r['tokens_per_s']} | {r['step_ms']} | "
                     f"{r['peak_mem_gib']} | {_ratio(r['tokens_per_s'], train.get('tokens_per_s'))} |")
    lines += ["", "### GRPO (1B shape, random init: a speed figure)", "",
              "| engine | rollouts/s | step s | generation s | training s | completion tokens | peak GiB |",
              "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.get("part") == "grpo"):
        lines.append(f"| {r['engine']} | {r['rollouts_per_s']} | {r['step_s']} | {r['generation_s']} | "
                     f"{r['train_s']} | {r['completion_tokens']} | {r['peak_mem_gib']} |")
    lines += ["", "### Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['stage']} | {r['status']} | {r['seconds']} |" for r in rows if r.get("part") == "stage"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metrics")
    m.add_argument("path", type=Path)
    m.add_argument("--skip", type=int, default=10)
    m.add_argument("--part", required=True)
    m.add_argument("--label", required=True)
    m.add_argument("extra", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("--rows", type=Path, required=True)
    t.add_argument("--quant", type=Path, default=None)
    t.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "metrics":
        print(json.dumps(metrics_row(a.path, a.skip, a.part, a.label, a.extra)))
        return
    rows = [json.loads(line) for line in a.rows.read_text().splitlines() if line.startswith("{")]
    quant = json.loads(a.quant.read_text()) if a.quant and a.quant.is_file() else []
    text = table(rows, quant)
    atomic_write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
