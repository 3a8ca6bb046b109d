"""FP8 vs BF16 on one H200, Llama-3.2-1B shapes, batch 4 x 4096, compiled, bf16 AdamW (the anchors' optimizer):
every variant that runs here, one table (tokens/s, TFLOP/s, MFU, peak memory, ratios vs our BF16, vs
Megatron-Core+TE FP8 and vs Hugging Face).

    python3 bench/fp8_h200.py [--only NAME ...] [--steps 8] [--warmup 3] [--mcore]    (bench/h200_fp8.sh wraps it)

Each variant is one ``bench/train_gpt.py`` process (the real training loop; a fresh compile cache and memory
pool each), so a failing variant costs only its own row. TE variants run when ``transformer_engine.pytorch``
imports; the Hugging Face anchor when ``.device/hf_llama_baseline.py`` is there; the Megatron-Core+TE anchor
with ``--mcore`` when ``.device/mcore_llama_anchor.py`` and its packages are there. The table is printed after
every row (a cut-short call still shows what ran) and written to ``$OUT/fp8_h200.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MCORE_FP8, MCORE_BF16, HF = 64_300, 53_400, 47_900  # ../shared/bench/README.md, same shapes and machines
BF16_CEILING, FP8_CEILING = 736.0, 1330.0  # measured dense GEMM TFLOP/s on this H200 (issue 8)

COMMON = ["train.compile=true", "optim.master_weights=false"]
NATIVE = ["train.precision=fp8", "fp8.backend=native"]
TE = ["train.precision=fp8", "fp8.backend=te"]
VARIANTS = [
    ("bf16", []),
    ("fp8 native tensorwise", [*NATIVE, "fp8.recipe=tensorwise"]),
    ("fp8 native delayed", [*NATIVE, "fp8.recipe=delayed"]),
    ("fp8 native delayed fast-bwd", [*NATIVE, "fp8.recipe=delayed", "fp8.fast_accum_backward=true"]),
    ("fp8 native tensorwise fast-bwd", [*NATIVE, "fp8.recipe=tensorwise", "fp8.fast_accum_backward=true"]),
    ("fp8 native delayed fp8-head", [*NATIVE, "fp8.recipe=delayed", "fp8.output_layer=true"]),
    ("fp8 native delayed fast-bwd fp8-head", [*NATIVE, "fp8.recipe=delayed", "fp8.fast_accum_backward=true",
                                              "fp8.output_layer=true"]),
    ("fp8 native rowwise", [*NATIVE, "fp8.recipe=rowwise", "fp8.format=e4m3"]),
    ("fp8 te delayed", [*TE, "fp8.recipe=delayed"]),
    ("fp8 te tensorwise", [*TE, "fp8.recipe=tensorwise"]),
    ("fp8 te blockwise", [*TE, "fp8.recipe=blockwise", "fp8.format=e4m3"]),
]


def te_imports() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], check=False,
                           capture_output=True)
    return probe.returncode == 0


def run_json(cmd: list[str], timeout: int) -> tuple[dict | None, list[str]]:
    """Run a benchmark process; its last JSON line, and the lines worth showing (fp8 backend line, errors)."""
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, [f"timed out after {timeout}s", *out.splitlines()[-3:]]
    rows = [line for line in out.splitlines() if line.startswith("{")]
    notes = [line.strip() for line in out.splitlines() if "fp8: backend" in line]
    if proc.returncode != 0 or not rows:
        notes += [line for line in out.splitlines() if "Error" in line or "error" in line][-4:]
        return None, notes
    return json.loads(rows[-1]), notes


def loss_span(r: dict) -> str:
    """First and last training loss of a run (the sanity check that a fast row still learns)."""
    losses = r.get("losses")
    return f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else str(r.get("loss", ""))


def table(rows: list[dict], bf16_tps: float | None, hf_tps: float | None) -> str:
    hf_ref = hf_tps or HF
    lines = [("| run | tokens/s | step ms | model TFLOP/s | MFU (bf16 736) | of fp8 ceiling (1330) | peak GiB | loss (first → last) | "
              f"vs our BF16 | vs MCore+TE FP8 ({MCORE_FP8 / 1e3:.1f}k) | vs HF ({hf_ref / 1e3:.1f}k) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = r.get("tokens_per_s")
        if tps is None:
            lines.append(f"| {r['name']} | failed: {r.get('why', '')[:120]} ||||||||||")
            continue
        tf = r.get("model_tflops", 0.0)
        vs_bf16 = f"{tps / bf16_tps:.3f}x" if bf16_tps else ""
        lines.append(f"| {r['name']} | {tps:,} | {r.get('step_ms', '')} | {tf} | {tf / BF16_CEILING:.1%} | "
                     f"{tf / FP8_CEILING:.1%} | {r.get('peak_mem_gib', '')} | {loss_span(r)} | {vs_bf16} | {tps / MCORE_FP8:.3f}x | "
                     f"{tps / hf_ref:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all that can)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    ap.add_argument("--mcore", action="store_true", help="also run the Megatron-Core+TE FP8 anchor")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--shape", nargs="*", default=[], help="extra bench/train_gpt.py arguments (--model F, "
                                                            "--batch N, --seq N, key=value) for a smaller run")
    ap.add_argument("--budget", type=float, default=560.0,
                    help="seconds for the whole call: no new run starts when less than --reserve is left")
    ap.add_argument("--reserve", type=float, default=110.0, help="seconds one run needs at least")
    a = ap.parse_args()
    t0 = time.monotonic()

    def time_left() -> bool:
        left = a.budget - (time.monotonic() - t0)
        if left < a.reserve:
            print(f"### stopping: {left:.0f}s of the --budget left, less than --reserve {a.reserve:.0f}s", flush=True)
            return False
        return True

    have_te = te_imports()
    print(f"transformer_engine.pytorch imports: {have_te}", flush=True)
    rows: list[dict] = []
    bf16_tps = hf_tps = None
    out_dir = os.environ.get("OUT")

    def show() -> None:
        text = table(rows, bf16_tps, hf_tps)
        print(text, flush=True)
        if out_dir:
            Path(out_dir, "fp8_h200.md").write_text(text + "\n")

    for name, overrides in VARIANTS:
        if a.only and name not in a.only:
            continue
        if "fp8.backend=te" in overrides and not have_te:
            print(f"### {name}: skipped (Transformer Engine does not import)", flush=True)
            continue
        if not time_left():
            break
        start = time.monotonic()
        cmd = [sys.executable, "bench/train_gpt.py", "--label", name, "--steps", str(a.steps),
               "--warmup", str(a.warmup), "--print-losses", *COMMON, *overrides, *a.shape]
        print(f"### {name}: {' '.join(cmd[1:])}", flush=True)
        res, notes = run_json(cmd, min(a.timeout, int(a.budget - (time.monotonic() - t0)) - 5))
        for n in notes:
            print(f"    {n}", flush=True)
        row = {"name": name, **(res or {"why": (notes or ["no result"])[-1]})}
        rows.append(row)
        if name == "bf16" and res:
            bf16_tps = res["tokens_per_s"]
        print(f"    ({time.monotonic() - start:.0f}s)", flush=True)
        show()
    anchors = []
    if not a.no_hf and (REPO / ".device/hf_llama_baseline.py").exists():
        anchors.append(("HF Llama (anchor, same call)", [sys.executable, ".device/hf_llama_baseline.py"]))
    if a.mcore and (REPO / ".device/mcore_llama_anchor.py").exists():
        anchors.append(("Megatron-Core+TE fp8 (anchor, same call)",
                        [sys.executable, ".device/mcore_llama_anchor.py", "fp8"]))
    for name, cmd in anchors:
        if not time_left():
            break
        print(f"### {name}", flush=True)
        res, notes = run_json(cmd, min(a.timeout, int(a.budget - (time.monotonic() - t0)) - 5))
        rows.append({"name": name, **(res or {"why": "; ".join(notes[-2:]) or "no result"})})
        if res and name.startswith("HF"):
            hf_tps = res["tokens_per_s"]
        show()


if __name__ == "__main__":
    main()
