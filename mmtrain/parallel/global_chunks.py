"""Where this rank's tensors sit in the whole model: boxes of the global (unsharded) tensors.

A checkpoint stores every model tensor and optimizer state by its global name and global shape; each rank
contributes the boxes (offsets + sizes in the global tensor) it holds. Any other layout then reads the boxes it
needs, whatever layout wrote them — the storage (``torch.distributed.checkpoint``) finds the overlaps.

What a rank holds of parameter ``name``:
- tensor parallelism (the model's sharding spec, ``mmtrain.models.spec``): along one dim, either one even
  split, or a concatenation of parts (fused q|k|v, gate|up) each split evenly — rank r holds part i's r-th slice for every i, so its shard is
  several boxes of the global tensor;
- expert parallelism: experts ``[ep_rank * local, (ep_rank + 1) * local)`` of the spec's ``expert_dim``;
- distributed optimizer: a flat range [lo, hi) of the rank's (TP/EP) shard, which is a few boxes: a partial
  first row, a block of whole rows, a partial last row (recursively in more dims).
Data/context-parallel replicas produce identical boxes; the storage keeps one copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmtrain.utils.dcp_io import Chunk


@dataclass(frozen=True)
class _Box:
    """One box of a global tensor held by this rank, and where its values are in the local flat range."""

    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]
    flat: tuple[int, int]  # the contiguous run of the local flat range holding the leaf the box is cut from
    leaf: tuple[int, ...]  # that run's shape
    narrow: tuple[int, int, int] | None  # (dim, start, length) of the leaf, when the box is only part of it

    def of_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """The box's values as a view of ``flat`` (the local flat range the boxes were computed for)."""
        view = flat[self.flat[0]:self.flat[1]].view(self.leaf)
        return view if self.narrow is None else view.narrow(*self.narrow)

    def of_global(self, full: torch.Tensor) -> torch.Tensor:
        """The box's values as a view of the whole global tensor."""
        return full[tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))]


@dataclass(frozen=True)
class Shard:
    """How this rank's copy of a parameter is cut from the global tensor."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1


def shard_of(mesh) -> Shard:
    return Shard(mesh.coord.tp, mesh.dims.tp, mesh.coord.ep, mesh.dims.ep)


def _tp_parts(name: str, local_shape: tuple[int, ...], spec, tp: int) -> tuple[int, list[int]] | None:
    """(dim, local part sizes along it) when ``name`` is TP-sharded, else None."""
    split = spec[name].tp_split() if tp > 1 else None
    if split is None:
        return None
    dim, parts = split
    if parts is None:
        return dim, [local_shape[dim]]
    if any(p % tp for p in parts) or sum(parts) // tp != local_shape[dim]:
        raise ValueError(f"{name}: local shape {tuple(local_shape)} is not a {tp}-way split of parts {parts}")
    return dim, [p // tp for p in parts]


def global_shape(name: str, local_shape: tuple[int, ...], spec, shard: Shard) -> tuple[int, ...]:
    """The global shape of parameter ``name`` from this rank's shard of it (``spec``: the model's spec)."""
    shape = list(local_shape)
    expert_dim = spec[name].expert_dim
    if expert_dim is not None:
        shape[expert_dim] *= shard.ep
    tp = _tp_parts(name, tuple(local_shape), spec, shard.tp)
    if tp is not None:
        shape[tp[0]] *= shard.tp
    return tuple(shape)


def _leaves(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...] = (), base: int = 0):
    """Contiguous boxes covering the flat range [lo, hi) of a tensor of ``shape``:
    (flat start, flat end, local offsets, sizes). Each is fixed leading indices, a range of one dim, whole
    trailing dims."""
    if lo >= hi:
        return
    if not shape:
        yield base, base + 1, prefix, ()
        return
    m = math.prod(shape[1:])
    if lo % m:  # a partial first row
        row = lo // m
        end = min(hi, (row + 1) * m)
        yield from _leaves(shape[1:], lo - row * m, end - row * m, (*prefix, row), base + row * m)
        lo = end
    a, b = lo // m, hi // m
    if b > a:  # whole rows
        yield (base + a * m, base + b * m, (*prefix, a, *[0] * (len(shape) - 1)),
               (*[1] * len(prefix), b - a, *shape[1:]))
        lo = b * m
    if lo < hi:  # a partial last row
        row = lo // m
        yield from _leaves(shape[1:], 0, hi - row * m, (*prefix, row), base + row * m)


def boxes(name: str, local_shape: tuple[int, ...], spec, shard: Shard, lo: int = 0, hi: int | None = None) -> list[_Box]:
    """The global boxes of the flat range [lo, hi) (default: all) of this rank's shard of parameter ``name``;
    ``_Box.flat`` is relative to ``lo``."""
    local_shape = tuple(local_shape)
    hi = math.prod(local_shape) if hi is None else hi
    tp = _tp_parts(name, local_shape, spec, shard.tp)
    expert_dim = spec[name].expert_dim if shard.ep > 1 else None
    out = []
    for f0, f1, off, sizes in _leaves(local_shape, lo, hi):
        g = list(off)
        if expert_dim is not None:
            g[expert_dim] += shard.ep_rank * local_shape[expert_dim]
        if tp is None:
            out.append(_Box(tuple(g), sizes, (f0 - lo, f1 - lo), sizes, None))
            continue
        dim, local_parts = tp
        start, end = off[dim], off[dim] + sizes[dim]
        local_at = global_at = 0
        for lp in local_parts:  # cut the leaf at part boundaries; part i of rank r is at i's start + r * lp
            s, e = max(start, local_at), min(end, local_at + lp)
            if s < e:
                g[dim] = global_at + shard.tp_rank * lp + (s - local_at)
                cut = tuple(e - s if d == dim else n for d, n in enumerate(sizes))
                whole = s == start and e == end
                out.append(_Box(tuple(g), cut, (f0 - lo, f1 - lo), sizes, None if whole else (dim, s - start, e - s)))
            local_at += lp
            global_at += lp * shard.tp
    return out


def stored_name(name: str, spec) -> str:
    """The global name a parameter is stored under: a tied copy (the last stage's copy of a tied embedding) is
    stored as the tensor it copies."""
    return spec.stored_name(name)


def chunks_of(key: str, name: str, local_shape: tuple[int, ...], flat: torch.Tensor, spec, shard: Shard, lo: int = 0,
              copy=None) -> list[Chunk]:
    """``Chunk``s (stored as ``key``) of the flat range [lo, lo + flat.numel()) of this rank's shard of parameter
    ``name`` (shape ``local_shape``), whose values are ``flat``. ``copy`` maps each box's view to what is saved
    (e.g. a host copy); without it the chunks are views of ``flat`` (what a load fills)."""
    shape = global_shape(name, tuple(local_shape), spec, shard)
    out = []
    for b in boxes(name, tuple(local_shape), spec, shard, lo, lo + flat.numel()):
        view = b.of_flat(flat)
        out.append(Chunk(key, shape, b.offsets, copy(view) if copy is not None else view))
    return out


def chunks_from_global(key: str, name: str, full: torch.Tensor, spec, shard: Shard) -> list[Chunk]:
    """The chunks of parameter ``name`` that a rank of ``shard``'s coordinates holds, as views of the whole
    global tensor ``full`` (for writing a checkpoint of some layout from full tensors)."""
    local = list(full.shape)
    expert_dim = spec[name].expert_dim
    if expert_dim is not None:
        local[expert_dim] //= shard.ep
    split = spec[name].tp_split() if shard.tp > 1 else None
    if split is not None:
        local[split[0]] //= shard.tp
    return [Chunk(key, tuple(full.shape), b.offsets, b.of_global(full)) for b in boxes(name, tuple(local), spec, shard)]


def model_load_chunks(model_state: dict[str, torch.Tensor], spec, shard, saved: dict) -> tuple[list[Chunk], list[str]]:
    """Chunks filling ``model_state`` (views of it) from a checkpoint holding ``saved`` (``saved_tensors``), and
    the names it has no value for. A buffer the checkpoint lacks (a sigmoid router's balancing bias: Hugging
    Face models have none) is zeroed, its state before any step."""
    chunks, missing = [], []
    for name, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            continue  # a module's non-tensor extra state: not stored
        key = f"model.{stored_name(name, spec)}"
        if key not in saved and spec[name].buffer:
            t.zero_()
            continue
        if key not in saved:
            missing.append(name)
            continue
        chunks += chunks_of(key, name, tuple(t.shape), t.view(-1), spec, shard)
    return chunks, missing
