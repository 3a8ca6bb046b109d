"""Parallelism: one layout object (``ParallelDims``) builds every process group once (``ParallelMesh``),
and the per-dimension modules take the groups they need from it explicitly.

Public names load lazily, so the layout arithmetic (``ParallelDims``, ``LayoutError``) is usable without
importing torch: the entry points check a layout before ``--help`` or a config error would pay for it."""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    "GROUP_NAMES": "mmtrain.parallel.dims", "LayoutError": "mmtrain.parallel.dims",
    "ParallelDims": "mmtrain.parallel.dims", "ParallelMesh": "mmtrain.parallel.dims",
    "RankCoord": "mmtrain.parallel.dims", "init_distributed": "mmtrain.parallel.launch",
    "pick_device": "mmtrain.parallel.launch", "shutdown_distributed": "mmtrain.parallel.launch",
}
__all__ = ["GROUP_NAMES", "LayoutError", "ParallelDims", "ParallelMesh", "RankCoord", "init_distributed",
           "pick_device", "shutdown_distributed"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
