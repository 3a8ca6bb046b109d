"""The parallel layout: sizes, rank <-> coordinates, and every process group, built once and passed in.

Rank order (fastest-varying first), as Megatron-Core's default ``tp-cp-ep-dp-pp``::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

so tensor-parallel peers are neighbours (same node, fastest links), then context-, then data-parallel peers,
and pipeline stages are furthest apart.

Experts are sharded over the DP*CP ranks of a stage (as in Megatron-Core). Number those ranks
``dpcp = cp_rank + CP * dp_rank``; then ``ep_rank = dpcp % EP`` and the expert-data-parallel rank is
``edp_rank = dpcp // EP``. So each ``ep`` group is EP consecutive dp*cp ranks that hold different experts and
exchange tokens (all-to-all); each ``edp`` group (size DP*CP/EP) holds the same experts and all-reduces their
gradients. Dense (non-expert) gradients are reduced over ``dp_cp``.

Groups (each partitions the world; every rank belongs to exactly one group of each kind):

=========  ===============================  ==========================================================
name       varies                            used for
=========  ===============================  ==========================================================
tp         tp                               tensor/sequence parallel collectives
cp         cp                               context-parallel K/V exchange
dp         dp                               data sharding (CP ranks of one sample share data)
dp_cp      dp, cp                           dense gradient reduction, loss averaging
pp         pp                               pipeline send/recv
ep         ep slice of dp*cp                expert token all-to-all
edp        edp slice of dp*cp               expert gradient reduction
mp         tp, pp                           model-parallel reductions (grad norm, parameter counts)
=========  ===============================  ==========================================================

``ParallelDims`` is pure arithmetic (no processes needed, fully unit-tested); ``ParallelDims.build()``
creates the ``torch.distributed`` groups and returns a ``ParallelMesh`` for this rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "edp", "mp")


class LayoutError(ValueError):
    """The requested sizes do not fit the world size; the message names the sizes."""


class RankCoord(NamedTuple):
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int


def _layout_fix(world_size: int, model: int, **sizes: int) -> str:
    """What to change when the world size is not a multiple of tp*pp*cp: the process count, or the sizes."""
    procs = model * -(-world_size // model)  # the next multiple of tp*pp*cp
    smaller = " ".join(f"parallel.{name}=1" for name, size in sizes.items() if size > 1)
    return (f"; start a multiple of {model} processes (torchrun --nproc_per_node {procs}, or that many over the "
            f"nodes) or make tp*pp*cp divide {world_size} (e.g. {smaller})")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        sizes = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "ep": self.ep}
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {size!r}")
        if self.tp * self.pp * self.cp * self.dp != self.world_size:
            total = self.tp * self.pp * self.cp * self.dp
            raise LayoutError(
                f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {total} does not equal the world size "
                f"{self.world_size}; start {total} processes (torchrun --nproc_per_node {total}, or that many over "
                f"the nodes) or change the sizes (parallel.dp=0 infers dp)")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"parallel.ep ({self.ep}) must divide dp*cp = {self.dp}*{self.cp} = "
                              f"{self.dp * self.cp}: experts are sharded over the data- and context-parallel ranks")

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def infer(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp: int = 0) -> "ParallelDims":
        """Sizes with ``dp=0`` meaning "whatever is left of the world"."""
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        model = tp * pp * cp
        if model < 1:
            raise LayoutError(f"tp, pp and cp must be >= 1, got tp={tp} pp={pp} cp={cp}")
        if dp == 0:
            if world_size % model:
                raise LayoutError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model}"
                                  f"{_layout_fix(world_size, model, tp=tp, pp=pp, cp=cp)}")
            dp = world_size // model
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)

    @classmethod
    def from_config(cls, parallel_cfg: Any, world_size: int) -> "ParallelDims":
        """From a ``ParallelConfig`` (``dp=0`` inferred)."""
        p = parallel_cfg
        return cls.infer(world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp)

    # --------------------------------------------------------------------------------------- rank arithmetic
    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        dpcp = cp + self.cp * dp
        return RankCoord(tp=tp, cp=cp, dp=dp, pp=pp, ep=dpcp % self.ep, edp=dpcp // self.ep)

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        for name, value, size in (("tp", tp, self.tp), ("cp", cp, self.cp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name} coordinate {value} outside 0..{size - 1}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_ranks(self, name: str) -> list[list[int]]:
        """All groups of kind ``name``, each a sorted list of global ranks; together they partition the world."""
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown group '{name}'; known: {', '.join(GROUP_NAMES)}")
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)
            key = {
                "tp": (c.cp, c.dp, c.pp),
                "cp": (c.tp, c.dp, c.pp),
                "dp": (c.tp, c.cp, c.pp),
                "dp_cp": (c.tp, c.pp),
                "pp": (c.tp, c.cp, c.dp),
                "ep": (c.tp, c.pp, c.edp),
                "edp": (c.tp, c.pp, c.ep),
                "mp": (c.cp, c.dp),
            }[name]
            groups.setdefault(key, []).append(r)
        return sorted(groups.values(), key=lambda g: g[0])

    def size(self, name: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "dp_cp": self.dp * self.cp, "pp": self.pp,
                "ep": self.ep, "edp": self.edp, "mp": self.tp * self.pp}[name]

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} cp={self.cp} dp={self.dp} "
                f"ep={self.ep} (expert-dp={self.edp})")

    # ------------------------------------------------------------------------------------------- processes
    def build(self, rank: int | None = None, backend: str | None = None,
              timeout_s: float | None = None, node_local_rank: int | None = None) -> "ParallelMesh":
        """Create every process group (collective over all ranks: call once, on every rank, in the same order).
        ``timeout_s``: how long a collective on these groups may wait (torch's default otherwise: 30 min).
        ``node_local_rank``: this process's index on its node (default: the launcher's, ``launch.node_local_rank``)."""
        import datetime

        import torch.distributed as dist

        from mmtrain.parallel.launch import node_local_rank as launched_local_rank  # imports torch

        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call mmtrain.parallel.init_distributed() first")
        if dist.get_world_size() != self.world_size:
            raise LayoutError(f"layout is for world size {self.world_size} but torch.distributed has "
                              f"{dist.get_world_size()} ranks")
        rank = dist.get_rank() if rank is None else rank
        mine: dict[str, Any] = {}
        for name in GROUP_NAMES:
            for ranks in self.group_ranks(name):
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if rank in ranks:
                    mine[name] = (group, ranks)
        # Tied embeddings under PP: the first and last stage of each pipeline keep their copies equal.
        for ranks in self.embedding_group_ranks():
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine["embd"] = (group, ranks)
        local = launched_local_rank() if node_local_rank is None else node_local_rank
        return ParallelMesh(dims=self, rank=rank, coord=self.coord(rank), _groups=mine, node_local_rank=local)

    def embedding_group_ranks(self) -> list[list[int]]:
        """[first stage, last stage] of every pipeline (empty when pp == 1); middle stages belong to none."""
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.group_ranks("pp")]


@dataclass
class ParallelMesh:
    """This rank's view of the layout: its coordinates and the process group of each kind it belongs to."""

    dims: ParallelDims
    rank: int
    coord: RankCoord
    _groups: dict[str, tuple[Any, list[int]]] = field(repr=False)
    node_local_rank: int = 0  # index among this node's processes: local rank 0 builds the node's data indices

    def group(self, name: str) -> Any:
        """The group of kind ``name`` holding this rank; ``embd`` is None on middle pipeline stages."""
        if name == "embd" and name not in self._groups:
            return None
        return self._groups[name][0]

    def ranks(self, name: str) -> list[int]:
        return list(self._groups[name][1])

    def size(self, name: str) -> int:
        return self.dims.size(name)

    def local_rank(self, name: str) -> int:
        """This rank's index inside its group of kind ``name``."""
        return self._groups[name][1].index(self.rank)

    # Shorthands for the groups model and training code use most.
    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))
    dp_group = property(lambda self: self.group("dp"))
    dp_cp_group = property(lambda self: self.group("dp_cp"))
    pp_group = property(lambda self: self.group("pp"))
    ep_group = property(lambda self: self.group("ep"))
    edp_group = property(lambda self: self.group("edp"))

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.dims.pp - 1


def factorizations(world_size: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, pp, cp, dp) whose product is ``world_size`` (for tests and layout search)."""
    divs = [d for d in range(1, world_size + 1) if world_size % d == 0]
    out = []
    for tp, pp, cp in itertools.product(divs, repeat=3):
        if world_size % (tp * pp * cp) == 0:
            out.append((tp, pp, cp, world_size // (tp * pp * cp)))
    return out
