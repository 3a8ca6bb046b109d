"""One ``bench/fp8_h200.py`` row of any tree, timed the same way for every tree: wall clock over the timed steps.

    python bench/wall_steps.py --tree DIR --row NAME [--steps 12] [--warmup 3] [train_gpt.py arguments ...]

Runs ``DIR/bench/train_gpt.py`` (that tree's loop and its own bench settings) in this process with the row's
overrides from this tree's ``bench/fp8_h200.py``, and times steps ``warmup+1 .. warmup+steps`` with a device
synchronisation before the first and after the last (``_Run.step``, in both trees): everything a step costs,
wherever the loop syncs. Prints the tree's own output (its JSON line: its step-timer figure), one JSON line with
``wall_tokens_per_s`` and ``wall_step_ms``, and a ``SUMMARY`` line with both figures and the losses.

Why: the trees' step timers measure different things. Before the issue-17 refactor the loop read the loss back
before the optimizer step and stopped its timer there, while the AdamW kernels were still running (the
preemption check's read, after the timer, waited for them), and its bench logged never; after it the loop
reads back only at logging steps, after the optimizer, and the bench logs every step, so its timer includes
the optimizer. ``bench/step_ops.py`` shows that on the CPU; this script compares the two trees like for like.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True, help="the mmtrain tree whose bench/train_gpt.py runs")
    ap.add_argument("--row", required=True, help="a variant name of bench/fp8_h200.py, e.g. bf16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    a, rest = ap.parse_known_args()
    tree = Path(a.tree).resolve()
    sys.path.insert(0, str(HERE))
    from fp8_h200 import COMMON, VARIANTS  # this tree's row definitions, the same for both trees

    overrides = dict(VARIANTS)[a.row]
    sys.path.insert(0, str(tree))
    import torch

    from mmtrain.train import loop

    assert Path(loop.__file__).resolve().is_relative_to(tree), f"imported {loop.__file__}, not from {tree}"
    first, last = a.warmup + 1, a.warmup + a.steps
    marks: dict[str, float] = {}
    step_fn = loop._Run.step

    def sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed_step(self, n):
        if n == first:
            sync(self.device)
            marks["start"] = time.perf_counter()
        out = step_fn(self, n)
        if n == last:
            sync(self.device)
            marks["end"] = time.perf_counter()
        return out

    loop._Run.step = timed_step
    keys = [x for x in rest if "=" in x and not x.startswith("-")]  # key=value after the options (argparse)
    options = [x for x in rest if x not in keys]
    sys.argv = [str(tree / "bench/train_gpt.py"), "--label", a.row, "--steps", str(a.steps), "--warmup",
                str(a.warmup), "--print-losses", *options, *COMMON, *overrides, *keys]
    captured = _Tee(sys.stdout)
    with contextlib.redirect_stdout(captured):
        runpy.run_path(str(tree / "bench/train_gpt.py"), run_name="__main__")
    if "end" not in marks:
        return
    dt = (marks["end"] - marks["start"]) / a.steps
    batch, seq = _shape(rest)
    wall = {"tree": str(tree), "row": a.row, "wall_step_ms": round(1000 * dt, 1),
            "wall_tokens_per_s": round(batch * seq / dt)}
    print(json.dumps(wall), flush=True)
    own = [json.loads(line) for line in captured.text.getvalue().splitlines() if line.startswith("{")]
    if own:
        r, losses = own[-1], own[-1].get("losses") or [float("nan")]
        print(f"SUMMARY {tree.name} | {a.row} | own step timer {r['tokens_per_s']:,} tokens/s ({r['step_ms']} ms) "
              f"| wall {wall['wall_tokens_per_s']:,} tokens/s ({wall['wall_step_ms']} ms) "
              f"| loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)


class _Tee(io.TextIOBase):
    """Passes the tree's output through and keeps a copy (its JSON line)."""

    def __init__(self, out) -> None:
        self.out, self.text = out, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def _shape(args: list[str]) -> tuple[int, int]:
    """--batch / --seq as train_gpt.py reads them (one device: tokens per step = batch x seq)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    known, _ = ap.parse_known_args(args)
    return known.batch, known.seq


if __name__ == "__main__":
    main()
