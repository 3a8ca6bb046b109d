"""Rank-aware console logging: rank 0 prints INFO, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import sys

_FORMAT = "[mmtrain %(asctime)s] %(message)s"


class _StdoutAtEmit(logging.StreamHandler):
    """Writes each record to ``sys.stdout`` as it is when the record is emitted, not when logging was set up: a
    caller that redirects stdout afterwards (``contextlib.redirect_stdout``, a notebook, a test's capture) gets
    the log there, and a stream closed since is never written to."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns one; stdout is looked up at each emit
        pass


def setup_logging(rank: int = 0, level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger("mmtrain")
    logger.handlers.clear()
    handler = _StdoutAtEmit()
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger(name: str = "mmtrain") -> logging.Logger:
    return logging.getLogger(name if name.startswith("mmtrain") else f"mmtrain.{name}")
