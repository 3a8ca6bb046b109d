"""Command-line pieces the entry points share (``mmtrain.generate``, ``mmtrain.serve``, the pretrain entry points)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument error is one line naming the program, then exit 2 (argparse would print the usage first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


# torchrun stops every worker (SIGTERM) as soon as the first one exits non-zero: a silent rank that got there first
# would kill the printing one before it printed. The silent ranks wait this long; torchrun stops them earlier.
SILENT_RANK_GRACE_S = 10.0


def startup_error(line: str, rank: int, local_rank: int) -> int:
    """Every rank finds the same start-up error (same config, same files), so only each node's first process
    prints ``line`` (once on one node, not once per rank; ``[rank N]`` before it on the other nodes) and the others
    wait before exiting (``SILENT_RANK_GRACE_S``). Returns the exit code, 2."""
    if local_rank == 0:
        print(f"{'' if rank == 0 else f'[rank {rank}] '}{line}", file=sys.stderr, flush=True)
    else:
        time.sleep(SILENT_RANK_GRACE_S)
    return 2


def checkpoint_display_name(ckpt: str | os.PathLike) -> str:
    """The name a checkpoint path goes by (e.g. the model name a server reports): its run's folder for a
    checkpoints root or a step folder in one (``runs/guide/checkpoints``, ``.../checkpoints/step_00000060`` ->
    ``guide``), else the folder's own name."""
    path = Path(ckpt).resolve()
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        path = path.parent
    if path.name == "checkpoints" and path.parent.name:
        path = path.parent
    return path.name
