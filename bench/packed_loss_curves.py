"""Packed (FlexAttention block masks) vs dense-mask reference loss curves: merge the two runs' step,loss CSVs
(``bench/train_gpt.py --losses-csv``) into one CSV, print how far apart they are, and draw a PNG when matplotlib
is there (the device may lack it: then run this again here on the returned CSV).

    python3 bench/packed_loss_curves.py --flex flex.csv --dense dense.csv --out bench/results/packed_loss_DATE.csv
    python3 bench/packed_loss_curves.py --merged bench/results/packed_loss_DATE.csv     # PNG from a merged CSV
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmtrain.utils.atomic import atomic_open, atomic_write_text  # noqa: E402


def _read(path: Path) -> dict[int, float]:
    with open(path, newline="") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def summary(rows: list[tuple[int, float, float]]) -> str:
    diffs = [abs(f - d) for _, f, d in rows]
    last = rows[-50:]
    return (f"{len(rows)} steps; first loss flex {rows[0][1]:.4f} / dense {rows[0][2]:.4f}; last flex {rows[-1][1]:.4f}"
            f" / dense {rows[-1][2]:.4f}; |flex - dense| mean {statistics.fmean(diffs):.4f}, max {max(diffs):.4f}; "
            f"mean of the last {len(last)} steps flex {statistics.fmean(r[1] for r in last):.4f} / dense "
            f"{statistics.fmean(r[2] for r in last):.4f}")


def plot(rows: list[tuple[int, float, float]], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no PNG; run this script on the merged CSV where it is installed)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[2] for r in rows], label="dense-mask reference (SDPA, S×S mask)", lw=2)
    ax.plot([r[0] for r in rows], [r[1] for r in rows], label="packed: FlexAttention block masks", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Packed documents: flex vs dense mask, same data and seed")
    ax.legend()
    fig.tight_layout()
    with atomic_open(png, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flex", type=Path)
    ap.add_argument("--dense", type=Path)
    ap.add_argument("--out", type=Path, help="merged CSV to write (step,flex,dense)")
    ap.add_argument("--merged", type=Path, help="an existing merged CSV (PNG and summary only)")
    a = ap.parse_args()
    if a.merged:
        with open(a.merged, newline="") as f:
            rows = [(int(r["step"]), float(r["flex"]), float(r["dense"])) for r in csv.DictReader(f)]
        out = a.merged
    else:
        flex, dense = _read(a.flex), _read(a.dense)
        rows = [(s, flex[s], dense[s]) for s in sorted(flex) if s in dense]
        out = a.out
        atomic_write_text(out, "step,flex,dense\n" + "".join(f"{s},{f:.6f},{d:.6f}\n" for s, f, d in rows))
        print(f"wrote {out}")
    print(summary(rows))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
