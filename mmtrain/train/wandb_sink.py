"""Weights & Biases sink of the per-step metrics (``logging.wandb=true``), rank 0 only.

It logs the same figures as ``metrics.jsonl`` (every numeric value of a row, nested ones as ``outer/inner``) at
the same step, and the resolved run config. ``wandb`` is imported only when a sink is made, so runs without
it never load it. The W&B run id is kept in ``run_dir/wandb_run_id`` so a resumed run continues the same
W&B run; W&B keeps a run's steps increasing, so it drops (with a warning of its own) the rows of steps that
a resume runs again -- ``metrics.jsonl`` is the record that replaces them. ``logging.wandb_mode=offline``
writes under ``run_dir/wandb/`` only (``wandb sync`` uploads it later); no network is touched.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from mmtrain.config.loader import ConfigError
from mmtrain.utils.atomic import atomic_write_text

RUN_ID_FILE = "wandb_run_id"


def wandb_figures(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric values of a metrics row, nested dicts flattened to ``outer/inner`` (lists and text left out)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(wandb_figures(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value  # NaN/inf too: metrics.jsonl has them (a skipped step's loss)
    return out


def _run_id(run_dir: Path) -> str:
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        kept = path.read_text(encoding="utf-8").strip()
        if kept.isalnum() and len(kept) <= 64:
            return kept
    new = secrets.token_hex(8)
    atomic_write_text(path, new + "\n")
    return new


class WandbSink:
    """One W&B run for this training run. ``logging``: the run's LoggingConfig; ``config``: the resolved config
    as a plain dict."""

    def __init__(self, logging, run_dir: str | Path, config: dict[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError as exc:  # validate.py checks this before any process group; kept for library use
            raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'mmtrain[wandb]'") from exc
        run_dir = Path(run_dir)
        try:
            self._run = wandb.init(
                project=logging.wandb_project, name=logging.wandb_name or run_dir.resolve().name,
                entity=logging.wandb_entity or None, tags=list(logging.wandb_tags) or None, mode=logging.wandb_mode,
                dir=str(run_dir), id=_run_id(run_dir), resume="allow", config=config or {},
                settings=wandb.Settings(console="off", silent=True))
        except Exception as exc:  # noqa: BLE001 - not logged in, no network, a refused entity: one line
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"logging.wandb: W&B could not start the run ({type(exc).__name__}: {first}); run "
                              "`wandb login`, or set logging.wandb_mode=offline (sync later) or logging.wandb=false") \
                from None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        figures = wandb_figures(metrics)
        if figures:
            self._run.log(figures, step=step)

    def close(self) -> None:
        self._run.finish()
