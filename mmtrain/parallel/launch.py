"""Process-group start-up from torchrun's (or Slurm-through-torchrun's) environment.

mmtrain has no launcher of its own: ``torchrun`` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and
this module only reads them. A plain ``python -m ...`` (no torchrun) runs as a world of one.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def node_local_rank() -> int:
    """This process's index among the processes of its node (torchrun's LOCAL_RANK; 0 without torchrun). Read
    here, at start-up, and handed on (``ParallelMesh.node_local_rank``), never read deeper down."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(kind: str = "auto") -> torch.device:
    """``auto`` -> this rank's GPU when CUDA is available, else the CPU."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    local_rank = node_local_rank()
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(backend: str = "auto", device: torch.device | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialize torch.distributed once; returns (rank, world_size). Idempotent."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend == "auto":
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        kwargs = {"device_id": device} if device is not None and device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    else:  # single process without torchrun: a private in-memory store
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Destroy the default process group (and with it every group the mesh built), if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
