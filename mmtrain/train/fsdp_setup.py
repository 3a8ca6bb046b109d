"""``parallel.fsdp``: which parameters form the fully sharded units of a stage (its transformer blocks), per
gradient-reduction group (``mmtrain.parallel.fsdp.FsdpBuckets``)."""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.fsdp import FsdpBuckets
from mmtrain.train.grads import split_by_reduce_group, tied_embedding_params
from mmtrain.train.precision import Precision


def fully_sharded_buckets(stage: nn.Module, dense: list[nn.Parameter], experts: list[nn.Parameter],
                          mesh: ParallelMesh, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                          precision: Precision, trainable: bool = True) -> list[FsdpBuckets]:
    """One ``FsdpBuckets`` for the dense parameters (over dp x cp) and, with routed experts, one for the expert
    weights (over the expert-data-parallel ranks); each block of ``stage.layers`` is a unit of both, in forward
    order (its global layer index), the rest stays whole. ``precision`` adds to the dense one (FP8: the blocks'
    FP8 weights in buckets of their own, gathered in FP8). ``trainable=False``: no gradients (a frozen model)."""
    blocks = sorted(stage.layers.items(), key=lambda kv: int(kv[0]))
    out = []
    for params, group, late in ((dense, mesh.dp_cp_group, tied_embedding_params(stage) if trainable else []),
                                (experts, mesh.edp_group, [])):
        if not params:
            continue
        mine = {id(p) for p in params}
        units, modules, in_unit = [], [], set()
        for _, block in blocks:
            unit = [p for p in block.parameters() if id(p) in mine]
            if unit:
                units.append(unit)
                modules.append(block)
                in_unit.update(id(p) for p in unit)
        resident = [p for p in params if id(p) not in in_unit]
        options = precision.fsdp_options(in_unit) if params is dense else {}  # experts stay BF16
        out.append(FsdpBuckets(units, modules, resident, group, param_dtype, grad_dtype, late_params=late,
                               trainable=trainable, **options))
        if params is dense:
            precision.attach_fsdp(out[-1])
    return out


def fully_sharded_frozen(model: nn.Module, mesh: ParallelMesh) -> list[FsdpBuckets]:
    """A frozen model (the DPO reference) sharded like the trained stage: each block gathered for its forward
    and freed after, in the dtype it was built in; no gradients, no optimizer."""
    params = list(model.parameters())
    dense, experts = split_by_reduce_group(model, params)
    dtype = params[0].dtype
    return fully_sharded_buckets(model, dense, experts, mesh, dtype, dtype, Precision(), trainable=False)
