"""Parallelism: one layout object (``ParallelDims``) builds every process group once (``ParallelMesh``),
and the per-dimension modules take the groups they need from it explicitly."""

from mmtrain.parallel.dims import GROUP_NAMES, LayoutError, ParallelDims, ParallelMesh, RankCoord
from mmtrain.parallel.launch import init_distributed, pick_device, shutdown_distributed

__all__ = ["GROUP_NAMES", "LayoutError", "ParallelDims", "ParallelMesh", "RankCoord", "init_distributed",
           "pick_device", "shutdown_distributed"]
