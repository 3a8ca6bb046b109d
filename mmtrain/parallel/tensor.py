"""Tensor (and sequence) parallelism: sharded linears/embedding, vocab-parallel cross-entropy, the TP plan.

The model is built whole for one device and initialized; ``apply_tensor_parallel`` then replaces its linears
and embedding by modules holding this rank's shard, so a TP run starts from exactly the single-process weights.
What is sharded, and how, comes from the model's sharding spec (``model.sharding_spec()``, a
``mmtrain.models.spec.ShardingSpec``): ``column`` / ``row`` linears, ``vocab`` embedding and output layer, fused
parts. The same spec tells the gradient and norm code (``mmtrain.train.grads``) which tensors are TP shards and
which replicated ones have gradients partial over TP; no parameter carries attributes.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmtrain.parallel.comm import copy_to_group, gather_seq, gather_seq_no_reduce, reduce_from_group, reduce_scatter_seq


def _shard_parts(t: torch.Tensor, parts: tuple[int, ...], rank: int, n: int, dim: int = 0,
                 unit: int = 1) -> torch.Tensor:
    """This rank's rows of a tensor made of concatenated ``parts`` along ``dim`` (each part split n ways, in
    whole blocks of ``unit`` rows)."""
    pieces = t.split(list(parts), dim=dim)
    for size in parts:
        if size % n or (size // n) % unit:
            raise ValueError(f"cannot split a part of size {size} over {n} tensor-parallel ranks"
                             + (f" in whole blocks of {unit}" if unit > 1 else ""))
    return torch.cat([p.chunk(n, dim=dim)[rank] for p in pieces], dim=dim).contiguous()


def _param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """This rank's piece as a parameter, trainable or frozen as the whole one was (a LoRA base is frozen)."""
    return nn.Parameter(data, requires_grad=like.requires_grad)


def _with_base_adapter(adapter: nn.Module, x: torch.Tensor, base: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, input_group) -> torch.Tensor:
    """A linear's output with an adapter that needs its bias-free output ``base`` (DoRA: ``mmtrain.model.lora``)."""
    y = base + adapter(x, base, weight, input_group)
    return y + bias if bias is not None else y


class ColumnParallelLinear(nn.Module):
    """Output features split over TP; input replicated (or gathered along the sequence under SP)."""

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool, parts: tuple[int, ...] = (),
                 unit: int = 1, copy_input: bool = True) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.copy_input = copy_input  # False: the input is already in the TP region (spec tp_input "local")
        self.part_sizes = tuple(parts) or (full.out_features,)  # fused blocks (the spec's), each split n ways
        self.weight = _param(_shard_parts(full.weight.data, self.part_sizes, r, n, unit=unit), full.weight)
        self.bias = (_param(_shard_parts(full.bias.data, self.part_sizes, r, n, unit=unit), full.bias)
                     if full.bias is not None else None)
        self.matmul = F.linear  # an F.linear-like hook: FP8 (mmtrain.model.fp8) swaps in its own matmul
        # a LoRA adapter (mmtrain.model.lora) on the same input; the plan shards its B like this weight
        self.adapter = getattr(full, "adapter", None)

    input_split_group = None  # whole input rows: a DoRA adapter's row norms are local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)
        if self.adapter is not None and self.adapter.needs_base:
            return _with_base_adapter(self.adapter, x, self.matmul(x, self.weight, None), self.weight, self.bias, None)
        y = self.matmul(x, self.weight, self.bias)
        return y + self.adapter(x) if self.adapter is not None else y


class RegionEntryLinear(nn.Module):
    """A replicated linear that opens a TP region (spec ``tp_input: copy``): whole weight, input copied over TP
    (gathered along the sequence under SP) so the gradient reaching its input is summed over TP; the column
    linears after it take its output as is (``tp_input: local``)."""

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = full.weight
        self.bias = full.bias
        self.part_sizes = getattr(full, "part_sizes", (full.out_features,))
        # a LoRA adapter on the same copied input, whole like this weight (its gradients partial over TP)
        self.adapter = getattr(full, "adapter", None)

    input_split_group = None  # a whole weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)
        if self.adapter is not None and self.adapter.needs_base:
            return _with_base_adapter(self.adapter, x, F.linear(x, self.weight), self.weight, self.bias, None)
        y = F.linear(x, self.weight, self.bias)
        return y + self.adapter(x) if self.adapter is not None else y


class RowParallelLinear(nn.Module):
    """Input features split over TP; partial outputs summed (or reduce-scattered along the sequence under SP)."""

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _param(full.weight.data.chunk(n, dim=1)[r].contiguous(), full.weight)
        self.bias = _param(full.bias.data.clone(), full.bias) if full.bias is not None else None
        self.matmul = F.linear  # as in ColumnParallelLinear
        # a LoRA adapter on the same (split) input: the plan splits its A like this weight, so A's partial
        # outputs are summed over TP like this linear's
        self.adapter = getattr(full, "adapter", None)
        self.input_split_group = group  # a DoRA adapter sums its squared row norms over it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, None)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_group(y, self.group)
        if self.adapter is not None and self.adapter.needs_base:
            return _with_base_adapter(self.adapter, x, y, self.weight, self.bias, self.group)
        y = y + self.bias if self.bias is not None else y
        return y + self.adapter(x) if self.adapter is not None else y


class _VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over TP; each rank looks up its range, the partial results are summed."""

    def __init__(self, full: nn.Embedding, group, sequence_parallel: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = r * full.num_embeddings // n
        self.vocab_end = (r + 1) * full.num_embeddings // n
        self.weight = _param(full.weight.data[self.vocab_start:self.vocab_end].clone(), full.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_scatter_seq(out, self.group) if self.sequence_parallel else reduce_from_group(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, vocab_start, group):
        logits = logits_NV.float()
        vmax = logits.max(dim=-1).values
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
        logits = logits - vmax[:, None]
        local_t = target_N - vocab_start
        outside = (local_t < 0) | (local_t >= logits.shape[-1])
        local_t = local_t.masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        predicted = logits[rows, local_t].masked_fill(outside, 0.0)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([predicted, sum_exp])
        dist.all_reduce(both, group=group)
        predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        exp.div_(sum_exp[:, None])  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, outside)
        ctx.input_dtype = logits_NV.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_N):
        softmax, local_t, outside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad = softmax
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        grad.mul_(grad_N[:, None])
        return grad.to(ctx.input_dtype), None, None, None


def _vocab_parallel_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token loss (B, S) from vocab-sharded logits; full logits are never gathered."""
    loss = _VocabParallelCrossEntropy.apply(logits_BSV.flatten(0, 1), labels_BS.flatten(), vocab_start, group)
    return loss.view_as(labels_BS)


class VocabParallelHead(nn.Module):
    """The output head of a vocab-sharded model (the methods of ``mmtrain.model.head.LossHead``): its input is
    copied over TP (gathered along the sequence under SP), the loss is the vocab-parallel cross-entropy (full
    logits are never gathered for it), ``full_logits`` gathers the vocabulary shards."""

    def __init__(self, group, sequence_parallel: bool, vocab_start: int, matmul: nn.Module | None = None) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.vocab_start = group, sequence_parallel, vocab_start
        self.matmul = matmul

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if self.matmul is None else self.matmul(x, weight)

    def loss(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_cross_entropy(logits, labels_BS, self.group, self.vocab_start)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_seq_no_reduce(logits, self.group, dim=-1)

    def compile_loss(self) -> None:
        """Nothing to compile: the vocab-parallel cross-entropy is its own autograd function."""


def _sharded_module(module: nn.Module, spec, group, sp: bool) -> nn.Module | None:
    """The TP replacement of ``module`` per its weight's spec entry, or None when it stays whole."""
    if isinstance(module, nn.Embedding) and spec.tp == "vocab":
        return _VocabParallelEmbedding(module, group, sp)
    if isinstance(module, nn.Linear) and spec.tp_input == "copy":
        return RegionEntryLinear(module, group, sp)
    if not isinstance(module, nn.Linear) or spec.tp == "replicated":
        return None
    if spec.tp == "column":
        return ColumnParallelLinear(module, group, sp, spec.parts, spec.unit, copy_input=spec.tp_input != "local")
    if spec.tp == "row":
        return RowParallelLinear(module, group, sp)
    # vocab-split output layer: a plain linear on this rank's vocabulary rows (the head copies/gathers its input)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    out = nn.Linear(module.in_features, module.out_features // n, bias=False)
    out.weight = _param(module.weight.data.chunk(n, dim=0)[r].contiguous(), module.weight)
    return out


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Shard a model (a ``mmtrain.models.contract.TensorParallelModel``: a family's stage, a VLM encoder) in place
    over the TP ``group``: its layout set (``set_sequence_parallel``), every ``nn.Linear`` / ``nn.Embedding``
    whose weight its ``sharding_spec()`` places ``column``, ``row`` or ``vocab`` becomes its sharded
    counterpart, and its output head, if any, becomes the vocab-parallel one (``swap_head``)."""
    n = dist.get_world_size(group)
    if n == 1:
        return model
    sp = sequence_parallel
    model.set_sequence_parallel(sp)  # the layout its spec resolves partial gradients for
    spec = model.sharding_spec()
    param_names = {id(p): n for n, p in model.named_parameters()}
    in_linears = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))
                  for p in m.parameters(recurse=False)}
    # sharded tensors outside any linear (a DoRA magnitude, split like its linear's output features)
    loose = [(n, p) for n, p in model.named_parameters() if spec[n].tp_sharded and id(p) not in in_linears]
    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):  # placed by its weight's entry
            new = _sharded_module(module, spec[param_names[id(module.weight)]], group, sp)
            if new is not None:
                swaps.append((name, new))
    for name, new in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    rank = dist.get_rank(group)
    for name, p in loose:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                _param(tp_shard_of(name, p.data, spec, rank, n), p))
    model.swap_head(lambda head, vocab_size: VocabParallelHead(group, sp, rank * vocab_size // n, head.matmul))
    return model


@torch.no_grad()
def allreduce_tp_partial_grads(model: nn.Module, group) -> None:
    """Sum the gradients that each TP rank holds only a part of (the spec's ``tp_partial_grad``)."""
    if dist.get_world_size(group) == 1:
        return
    spec = model.sharding_spec()
    grads = [p.grad for name, p in model.named_parameters() if spec[name].grad_partial_over_tp and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


def tp_partition(name: str, spec) -> tuple[int, tuple[int, ...] | None] | None:
    """How parameter ``name`` is split over TP: (dim, parts) — parts None means one even split — or None when
    it is replicated. ``spec``: the model's ``ShardingSpec``. Shared by tests and checkpoint resharding."""
    return spec[name].tp_split()


def tp_shard_of(name: str, full: torch.Tensor, spec, rank: int, n: int) -> torch.Tensor:
    """This TP rank's piece of the full tensor of parameter ``name``."""
    split = tp_partition(name, spec)
    if split is None or n == 1:
        return full
    dim, parts = split
    return _shard_parts(full, parts or (full.shape[dim],), rank, n, dim=dim)
