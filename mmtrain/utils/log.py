"""Rank-aware console logging: rank 0 prints INFO, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import sys

_FORMAT = "[mmtrain %(asctime)s] %(message)s"


def setup_logging(rank: int = 0, level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger("mmtrain")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger(name: str = "mmtrain") -> logging.Logger:
    return logging.getLogger(name if name.startswith("mmtrain") else f"mmtrain.{name}")
