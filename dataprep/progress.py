"""The progress-bar convention every `mmtrain-prep` subcommand shares: ``--progress {auto,always,never}``.

``auto`` (the default) draws a bar only when stderr is a terminal, so logs and CI output stay free of bar
redraws; ``--no-progress`` is kept as a spelling of ``--progress never`` (older scripts use it with ``media``).
"""

from __future__ import annotations

import argparse
import sys

PROGRESS_MODES = ("auto", "always", "never")


def add_progress_argument(group) -> None:
    """``--progress`` and its alias ``--no-progress`` on a parser or argument group."""
    group.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                       help="progress bar on stderr: auto (default: only on a terminal), always or never")
    group.add_argument("--no-progress", dest="progress", action="store_const", const="never",
                       help="same as --progress never")


def progress_enabled(mode: str, stream=None) -> bool:
    """Whether to draw a bar for ``--progress mode`` on ``stream`` (default stderr)."""
    if mode not in PROGRESS_MODES:
        raise argparse.ArgumentTypeError(f"--progress must be one of {', '.join(PROGRESS_MODES)}, not {mode!r}")
    return mode == "always" or (mode == "auto" and (stream or sys.stderr).isatty())
