"""After backward: make every rank's gradients the exact gradient of the global mean loss, then clip.

Order: tied-embedding sum between first and last pipeline stage (into the late bucket) -> data(+context)-
parallel reduction -> TP partial sums on the reduced pieces this rank owns. The gradients stay sums over the
global batch's loss tokens: the optimizer step's fused AdamW kernel divides them by the token count (times the
clip's divisor), so neither makes a pass of its own over them; the norm is taken of the sums and divided.
The global norm counts each distinct parameter element exactly once across TP, PP and DP shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.train.optimizer import MixedPrecisionAdamW


def _named_specs(stage: nn.Module):
    """(name, parameter, spec entry) of every parameter of ``stage``, from its ``sharding_spec()``."""
    spec = stage.sharding_spec()
    return [(n, p, spec[n]) for n, p in stage.named_parameters()]


def split_by_reduce_group(stage: nn.Module, params: list[nn.Parameter]) -> tuple[list, list]:
    """``params`` (of ``stage``, in order) split by the spec's gradient-reduction group: (``dp_cp``, ``edp``) —
    expert weights are replicated only over the expert-data-parallel ranks."""
    group = {id(p): s.grad_reduce_group for _, p, s in _named_specs(stage)}
    return [p for p in params if group[id(p)] == "dp_cp"], [p for p in params if group[id(p)] == "edp"]


def tied_embedding_params(stage: nn.Module) -> list[nn.Parameter]:
    """The tied tensors of a stage that holds only one side of a tie (tied embeddings under PP: the embedding
    on the first stage, its copy on the last one — the spec's ``tied_to``); for a VLM, those of its language
    model. Frozen ones (no gradient) are left out."""
    if stage.pre_process and stage.post_process:
        return []  # both sides on one stage: the model uses one tensor
    spec = stage.sharding_spec()
    targets = {s.tied_to for s in spec.values() if s.tied_to}
    return [p for n, p in stage.named_parameters() if (spec[n].tied_to or n in targets) and p.requires_grad]


@torch.no_grad()
def finalize_grads(stage: nn.Module, mesh: ParallelMesh, buckets: list[GradBuckets], optimizer: MixedPrecisionAdamW,
                   num_tokens: float | torch.Tensor) -> None:
    """After the step's backward: sum tied embeddings over the first/last stage, reduce over data (and
    context, or expert-data) parallel ranks, sum TP partial gradients; the division by the global loss-token
    count (a float, or a 0-dim device tensor, which keeps the step free of host syncs) is handed to the
    optimizer's next step (``divide_grads_at_step``): one read and write of the gradients less (8 bytes a
    parameter: ~2.4 ms a 1B step at the H200's memory bandwidth)."""
    for p in tied_embedding_params(stage):
        dist.all_reduce(p.main_grad, group=mesh.group("embd"))
    for b in buckets:
        b.finish(None)
    device = buckets[0].device if buckets else None
    optimizer.divide_grads_at_step(torch.as_tensor(num_tokens, dtype=torch.float64, device=device), replace=True)
    if mesh.size("tp") > 1:
        partial_ids = {id(p) for _, p, s in _named_specs(stage) if s.grad_partial_over_tp}
        partial = [g for pc, g in optimizer.piece_grads() if id(pc.param) in partial_ids]
        if partial:
            flat = torch.cat([g.reshape(-1) for g in partial])
            dist.all_reduce(flat, group=mesh.tp_group)
            torch._foreach_copy_(partial, list(flat.split([g.numel() for g in partial])))


@torch.no_grad()
def clip_grad_norm(stage: nn.Module, mesh: ParallelMesh, optimizer: MixedPrecisionAdamW,
                   max_norm: float) -> torch.Tensor:
    """Global L2 norm of the reduced gradients (a 0-dim float32 tensor on the device: ``float()`` reads it, a host
    sync the loop makes at logging steps only); clips them to ``max_norm`` in the optimizer's next ``step``.

    The gradients may still be sums the next ``step`` divides (``MixedPrecisionAdamW.grad_divisor``, the token
    count from ``finalize_grads``): the norm is taken of them and divided, so it is the divided gradients' norm.
    The clip stays on the device: the gradients are divided by ``max(1, (norm + 1e-6) / max_norm)`` (the
    reciprocal of torch's ``clip_grad_norm_`` coefficient) inside the fused AdamW kernel
    (``MixedPrecisionAdamW.divide_grads_at_step``), so a step that needs no clip costs no pass over the gradients
    and one that does costs one write, where an in-place multiply costs a read and a write every step. A
    non-finite norm makes the gradients non-finite too; the loop then skips the update
    (``MixedPrecisionAdamW.step(skip=...)``).

    A piece is counted by exactly one rank: its owner in its reduction group (every rank of a sharded group
    owns a distinct shard; an unsharded group counts on its rank 0), TP rank 0 for TP-replicated parameters,
    and never the last stage's copy of a tied embedding. Summing over dp×cp and then tp×pp covers the world."""
    copies = {id(p) for p in tied_embedding_params(stage) if stage.post_process}
    tp_sharded = {id(p) for _, p, s in _named_specs(stage) if s.tp_sharded} if mesh.size("tp") > 1 else set()
    tp_rank0 = mesh.coord.tp == 0
    pieces = optimizer.piece_grads()
    counted = [g for pc, g in pieces
               if id(pc.param) not in copies and (id(pc.param) in tp_sharded or tp_rank0)
               and (pc.owner.sharded or pc.owner.dp_rank == 0)]
    device = optimizer.buckets[0].device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        # one multi-tensor launch, not two kernels and their Python per piece (a VLM has ~530 pieces: ~15 ms of
        # host time a step, which the GPU waited for)
        sq = torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float32)).pow(2).sum()
    if mesh.size("dp_cp") > 1:
        dist.all_reduce(sq, group=mesh.dp_cp_group)
    if mesh.size("mp") > 1:
        dist.all_reduce(sq, group=mesh.group("mp"))
    norm = sq.sqrt()
    pending = optimizer.grad_divisor
    if pending is not None:
        norm = (norm.double() / pending).float()
    if max_norm and max_norm > 0 and pieces:
        # in float64 like the Python-float coefficient before; the kernel reads it as float32
        optimizer.divide_grads_at_step(torch.clamp((norm.double() + 1e-6) / max_norm, min=1.0))
    return norm
