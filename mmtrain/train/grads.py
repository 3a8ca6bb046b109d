"""After backward: make every rank's gradients the exact gradient of the global mean loss, then clip.

Order: TP partial sums -> tied-embedding sum between first and last pipeline stage -> data(+context)-parallel
sum, scaled by 1 / (global loss tokens). The global norm counts each distinct parameter element once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.data import allreduce_grads
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.tensor import allreduce_tp_partial_grads


def tied_embedding_params(stage: nn.Module) -> list[nn.Parameter]:
    """The embedding on the first stage and its copy on the last one (tied embeddings under PP)."""
    if not stage.cfg.tie_embeddings:
        return []
    out = []
    if stage.pre_process and stage.embed is not None and not stage.post_process:
        out.append(stage.embed.weight)
    if stage.post_process and stage.output is not None:
        out.append(stage.output.weight)
    return out


@torch.no_grad()
def finalize_grads(stage: nn.Module, mesh: ParallelMesh, num_tokens: float) -> None:
    allreduce_tp_partial_grads(stage, mesh.tp_group)
    tied = [p for p in tied_embedding_params(stage) if p.grad is not None]
    if tied and mesh.group("embd") is not None:
        for p in tied:
            dist.all_reduce(p.grad, group=mesh.group("embd"))
    params = [p for p in stage.parameters() if p.requires_grad]
    allreduce_grads(params, mesh.dp_cp_group, scale=1.0 / num_tokens)


@torch.no_grad()
def clip_grad_norm(stage: nn.Module, mesh: ParallelMesh, max_norm: float) -> float:
    """Global L2 norm over all model-parallel ranks; scales grads in place when it exceeds ``max_norm``."""
    copies = {id(p) for p in tied_embedding_params(stage) if stage.post_process and not stage.pre_process}
    tp_rank0 = mesh.coord.tp == 0
    grads, counted = [], []
    for p in stage.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if id(p) not in copies and (getattr(p, "tp_sharded", False) or tp_rank0):
            counted.append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        sq = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in counted]).sum()
    if mesh.size("mp") > 1:
        dist.all_reduce(sq, group=mesh.group("mp"))
    norm = sq.sqrt().item()
    if max_norm and max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
