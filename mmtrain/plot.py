"""Plots of training runs from their ``metrics.jsonl``: loss, validation loss, learning rate, tokens/s and MFU
against steps, several runs overlaid, one PNG per figure.

    python -m mmtrain.plot RUN_DIR [RUN_DIR ...] [--out DIR]

A RUN_DIR is a run's ``logging.run_dir`` (or its ``metrics.jsonl`` itself). PNGs go to ``RUN_DIR/plots/`` for
one run, to ``--out`` (default ``plots/``) for several. Needs matplotlib (``pip install 'mmtrain[plot]'``),
drawn off-screen (Agg). A missing or unreadable metrics file is a one-line error naming it (exit 2); only a
last line cut short by a killed run is left out, with a note.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mmtrain.utils.atomic import atomic_write_bytes

# (file stem, metrics.jsonl key, y-axis label, log scale)
FIGURES = (
    ("loss", "loss", "loss", False),  # training loss, with the validation loss dashed
    ("val_loss", "val_loss", "validation loss", False),
    ("lr", "lr", "learning rate", False),
    ("tokens_per_s", "tokens_per_s", "tokens/s per device", False),
    ("mfu", "mfu", "MFU (model FLOPs utilization)", False),
)


class PlotError(Exception):
    """A metrics file that cannot be plotted; the message names it."""


@dataclass
class RunMetrics:
    label: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    note: str = ""


def metrics_path(run: str | Path) -> Path:
    p = Path(run)
    return p if p.suffix == ".jsonl" else p / "metrics.jsonl"


def read_metrics(run: str | Path, label: str | None = None) -> RunMetrics:
    """Steps and values of every plotted key of one run; ``PlotError`` naming the file and line otherwise."""
    path = metrics_path(run)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlotError(f"{path}: not found; give a run folder (logging.run_dir) that holds metrics.jsonl") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: cannot read it ({exc})") from None
    out = RunMetrics(label or (path.parent.name if path.name == "metrics.jsonl" else path.stem), path)
    lines = text.split("\n")
    cut_short = lines[-1] != ""  # a killed run's last write, not ended by its newline
    lines = lines[:-1] if not cut_short else lines
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"step is {step!r}, not an integer")
        except (ValueError, KeyError, TypeError) as exc:
            if cut_short and number == len(lines):
                out.note = f"last line {number} cut short (a killed run?), left out"
                break
            what = "no 'step' key" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:120]
            raise PlotError(f"{path}:{number}: not a metrics row ({what}); metrics.jsonl holds one JSON object "
                            "per step, as the trainer writes it") from None
        for _, key, _, _ in FIGURES:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps, values = out.series.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    if not any(out.series.values()):
        raise PlotError(f"{path}: no metrics rows with {', '.join(k for _, k, _, _ in FIGURES)}")
    return out


def _labels(runs: list[str]) -> list[str]:
    names = [metrics_path(r).parent.name if metrics_path(r).name == "metrics.jsonl" else Path(r).stem for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]


def plot_runs(runs: list[str | Path], out: str | Path) -> list[Path]:
    """One PNG per figure any run has values for, the runs overlaid; returns the files written."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    except ImportError:
        raise PlotError("python -m mmtrain.plot needs matplotlib: pip install 'mmtrain[plot]'") from None
    data = [read_metrics(r, label) for r, label in zip(runs, _labels([str(r) for r in runs]))]
    written = []
    for stem, key, ylabel, log_y in FIGURES:
        with_values = [d for d in data if d.series.get(key)]
        if not with_values:
            continue
        fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        lines = 0
        for d in with_values:
            steps, values = d.series[key]
            drawn = ax.plot(steps, values, label=d.label if key != "loss" else f"{d.label} (training)",
                            marker="o" if len(steps) < 30 else None, markersize=3)
            lines += 1
            if key == "loss" and d.series.get("val_loss"):  # validation loss beside it, same colour, dashed
                v_steps, v_values = d.series["val_loss"]
                ax.plot(v_steps, v_values, "--o", color=drawn[0].get_color(), markersize=4,
                        label=f"{d.label} (validation)")
                lines += 1
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title({"loss": "training and validation loss"}.get(key, ylabel))
        if log_y:
            ax.set_yscale("log")
        if key == "mfu":
            ax.yaxis.set_major_formatter(lambda v, _: f"{100 * v:.0f}%")
        ax.grid(True, alpha=0.3)
        if lines > 1:
            ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        written.append(atomic_write_bytes(Path(out) / f"{stem}.png", buf.getvalue()))
    for d in data:
        if d.note:
            print(f"mmtrain.plot: {d.path}: {d.note}", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmtrain.plot", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (or their metrics.jsonl)")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots for one run, "
                                                "plots/ for several)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else (metrics_path(args.runs[0]).parent / "plots" if len(args.runs) == 1
                                           else Path("plots"))
    try:
        written = plot_runs(args.runs, out)
    except PlotError as exc:
        print(f"python -m mmtrain.plot: error: {exc}", file=sys.stderr)
        return 2
    missing = [k for stem, k, _, _ in FIGURES if out / f"{stem}.png" not in written]
    print(f"wrote {len(written)} plot(s) to {out}/: {', '.join(p.name for p in written)}"
          + (f" (no values for {', '.join(missing)}" + ("; MFU needs logging.peak_tflops" if "mfu" in missing
                                                         else "") + ")" if missing else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
