"""Per-step metrics: one console line per logged step on rank 0, a JSONL file, optional TensorBoard and other
sinks (``sinks``: objects with ``log(step, metrics)`` and ``close()``, e.g. ``wandb_sink.WandbSink``).

``metrics.jsonl`` keeps one row per step: a run resumed from the checkpoint of step k first removes the rows of
steps after k (logged by the interrupted run after its last checkpoint, now run again), and TensorBoard purges
its events after k the same way.

The line format is fixed and greppable::

    step 12/100 | loss 3.2104 | lr 3.00e-04 | grad_norm 1.234 | tok/s 12.3k | tflops 45.1 | mfu 6.1% | mem 3.2GiB | 412ms | eta 36s

``eta`` is the time left: the steps to go times the median of the last 20 step times (the median, so that the
first steps' compilation and an evaluation or checkpoint step do not swing it). It is on the line only.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path
from typing import Any

from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.log import get_logger

_ORDER = ("loss", "lr", "grad_norm", "tokens_per_s", "images_per_s", "tflops", "mfu", "mem_gib", "step_time_s")


def _fmt_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} {value}"
    if math.isnan(value) or math.isinf(value):
        return f"{key} {value}"
    if key == "lr":
        return f"lr {value:.2e}"
    if key == "tokens_per_s":
        return f"tok/s {value / 1000:.1f}k" if value >= 1000 else f"tok/s {value:.0f}"
    if key == "images_per_s":
        return f"img/s {value:.3g}"
    if key == "mfu":
        return f"mfu {100 * value:.1f}%"
    if key == "mem_gib":
        return f"mem {value:.1f}GiB"
    if key == "step_time_s":
        return f"{1000 * value:.0f}ms"
    if key == "tflops":
        return f"tflops {value:.3g}"
    if isinstance(value, int):
        return f"{key} {value}"
    return f"{key} {value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{key} {value:.3e}"


ETA_WINDOW = 20  # recent step times the time left is estimated from


def format_duration(seconds: float) -> str:
    """'45s', '12m05s', '3h07m', '2d04h'."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_step_line(step: int, total_steps: int, metrics: dict[str, Any], eta_s: float | None = None) -> str:
    metrics = {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}  # those go to metrics.jsonl
    keys = [k for k in _ORDER if k in metrics] + sorted(k for k in metrics if k not in _ORDER)
    eta = [f"eta {format_duration(eta_s)}"] if eta_s is not None and math.isfinite(eta_s) else []
    return " | ".join([f"step {step}/{total_steps}"] + [_fmt_value(k, metrics[k]) for k in keys] + eta)


class StepTimes:
    """The last ``window`` step times; ``eta(step, total)`` = steps left x their median (None before any)."""

    def __init__(self, window: int = ETA_WINDOW) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, seconds: Any) -> None:
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
            self.recent.append(float(seconds))

    def eta(self, step: int, total_steps: int) -> float | None:
        if not self.recent:
            return None
        return max(total_steps - step, 0) * statistics.median(self.recent)


def _drop_rows_after(path: Path, step: int, log) -> None:
    """Rewrite ``path`` (atomically) without the rows of steps after ``step`` and without a last line cut short
    by a killed run; says what it removed."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept, dropped, unreadable = [], [], 0
    for line in lines:
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            unreadable += 1
            continue
        (kept if row_step <= step else dropped).append((row_step, line))
    if not dropped and not unreadable:
        return
    atomic_write_text(path, "".join(line + "\n" for _, line in kept))
    what = []
    if dropped:
        steps = sorted({s for s, _ in dropped})
        what.append(f"{len(dropped)} row(s) of steps {steps[0]}..{steps[-1]}, which run again from step {step + 1}")
    if unreadable:
        what.append(f"{unreadable} unreadable line(s) (cut short when a run was killed)")
    log.warning(f"{path}: removed {' and '.join(what)}; one row per step")


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a no-op object with the same methods."""

    def __init__(self, run_dir: str | Path, rank: int = 0, total_steps: int = 0, log_every: int = 1,
                 tensorboard: bool = False, resume_step: int = 0, sinks: list | None = None) -> None:
        self.enabled = rank == 0
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self._log = get_logger("metrics")
        self._jsonl = None
        self._tb = None
        self._times = StepTimes()
        self._sinks = list(sinks or []) if self.enabled else []
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        _drop_rows_after(run_dir / "metrics.jsonl", resume_step, self._log)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise RuntimeError("logging.tensorboard=true needs the tensorboard package: "
                                   "pip install 'mmtrain[tensorboard]'") from exc
            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=resume_step + 1)

    def log_step(self, step: int, metrics: dict[str, Any], force: bool = False) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}", value, step)
            if metrics.get("samples"):  # train.sample_every: prompt -> completion, as markdown text
                self._tb.add_text("samples", "\n\n".join(f"**{s['prompt']}** {s['completion']}"
                                                          for s in metrics["samples"]), step)
        for sink in self._sinks:
            sink.log(step, metrics)
        self._times.add(metrics.get("step_time_s"))
        if force or step % self.log_every == 0 or step == self.total_steps:
            self._log.info(format_step_line(step, self.total_steps, metrics,
                                            self._times.eta(step, self.total_steps)))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()
