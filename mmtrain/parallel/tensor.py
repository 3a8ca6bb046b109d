"""Tensor (and sequence) parallelism: sharded linears/embedding, vocab-parallel cross-entropy, the GPT plan.

The model is built whole for one device and initialized; ``apply_tensor_parallel`` then replaces its linears
and embedding by modules holding this rank's shard, so a TP run starts from exactly the single-process weights.

Parameter attributes read by the gradient and norm code:
- ``tp_sharded``: the tensor is a shard (count it once per TP rank in the global norm);
- ``tp_partial_grad``: replicated over TP but each rank sees only part of the gradient (norm weights and
  row-linear biases under sequence parallelism, per-head-dim QK-norm weights) -> all-reduce over TP.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmtrain.parallel.comm import copy_to_group, gather_seq, gather_seq_no_reduce, reduce_from_group, reduce_scatter_seq


def _shard_parts(t: torch.Tensor, parts: tuple[int, ...], rank: int, n: int, dim: int = 0) -> torch.Tensor:
    """This rank's rows of a tensor made of concatenated ``parts`` along ``dim`` (each part split n ways)."""
    pieces = t.split(list(parts), dim=dim)
    for size in parts:
        if size % n:
            raise ValueError(f"cannot split a part of size {size} over {n} tensor-parallel ranks")
    return torch.cat([p.chunk(n, dim=dim)[rank] for p in pieces], dim=dim).contiguous()


def _mark(p: nn.Parameter | None, **flags: bool) -> None:
    if p is not None:
        for k, v in flags.items():
            setattr(p, k, v)


class ColumnParallelLinear(nn.Module):
    """Output features split over TP; input replicated (or gathered along the sequence under SP)."""

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.part_sizes = getattr(full, "part_sizes", (full.out_features,))
        self.weight = nn.Parameter(_shard_parts(full.weight.data, self.part_sizes, r, n))
        self.bias = nn.Parameter(_shard_parts(full.bias.data, self.part_sizes, r, n)) if full.bias is not None else None
        _mark(self.weight, tp_sharded=True)
        _mark(self.bias, tp_sharded=True)
        self.matmul = F.linear  # an F.linear-like hook: FP8 (mmtrain.model.fp8) swaps in its own matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split over TP; partial outputs summed (or reduce-scattered along the sequence under SP)."""

    def __init__(self, full: nn.Linear, group, sequence_parallel: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(full.weight.data.chunk(n, dim=1)[r].contiguous())
        self.bias = nn.Parameter(full.bias.data.clone()) if full.bias is not None else None
        _mark(self.weight, tp_sharded=True)
        _mark(self.bias, tp_partial_grad=sequence_parallel)
        self.matmul = F.linear  # as in ColumnParallelLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, None)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_group(y, self.group)
        return y + self.bias if self.bias is not None else y


class _VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over TP; each rank looks up its range, the partial results are summed."""

    def __init__(self, full: nn.Embedding, group, sequence_parallel: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = r * full.num_embeddings // n
        self.vocab_end = (r + 1) * full.num_embeddings // n
        self.weight = nn.Parameter(full.weight.data[self.vocab_start:self.vocab_end].clone())
        _mark(self.weight, tp_sharded=True)

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


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Shard a ``GPTModel`` (or one pipeline stage of it) in place over the TP ``group``. Any module with
    ``layers`` of ``TransformerBlock``s (the VLM's vision/audio encoders) is sharded the same way; ``embed`` and
    the output head are handled only where present."""
    n = dist.get_world_size(group)
    if n == 1:
        return model
    sp = sequence_parallel
    for block in model.layers.values():
        block.attn.qkv = ColumnParallelLinear(block.attn.qkv, group, sp)
        block.attn.proj = RowParallelLinear(block.attn.proj, group, sp)
        if hasattr(block.mlp, "up"):  # dense MLP; MoE experts stay whole per TP rank (parallel/expert.py)
            block.mlp.up = ColumnParallelLinear(block.mlp.up, group, sp)
            block.mlp.down = RowParallelLinear(block.mlp.down, group, sp)
        for norm in (block.attn_norm, block.mlp_norm):
            for p in norm.parameters():
                _mark(p, tp_partial_grad=sp)
        for norm in (block.attn.q_norm, block.attn.k_norm):  # shared over heads, each rank holds some heads
            if norm is not None:
                for p in norm.parameters():
                    _mark(p, tp_partial_grad=True)
    if getattr(model, "embed", None) is not None:
        model.embed = _VocabParallelEmbedding(model.embed, group, sp)
    if getattr(model, "post_process", False):
        for p in model.norm.parameters():
            _mark(p, tp_partial_grad=sp)
        r = dist.get_rank(group)
        vocab = model.cfg.vocab_size
        if model.output is not None:
            full = model.output
            model.output = nn.Linear(full.in_features, vocab // n, bias=False)
            model.output.weight = nn.Parameter(full.weight.data.chunk(n, dim=0)[r].contiguous())
            _mark(model.output.weight, tp_sharded=True)
        model.head_input_fn = partial(gather_seq, group=group) if sp else partial(copy_to_group, group=group)
        model.loss_fn = partial(_vocab_parallel_cross_entropy, group=group, vocab_start=r * vocab // n)
        model.logits_gather_fn = partial(gather_seq_no_reduce, group=group, dim=-1)
    return model


@torch.no_grad()
def allreduce_tp_partial_grads(model: nn.Module, group) -> None:
    """Sum the gradients that each TP rank holds only a part of (see the module docstring)."""
    if dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


def tp_partition(name: str, cfg) -> tuple[int, tuple[int, ...] | None] | None:
    """How the GPT parameter ``name`` is split over TP: (dim, parts) — parts None means one even split — or
    None when it is replicated. Shared by tests and checkpoint resharding. ``cfg``: a ``ModelConfig``, or a
    ``VLMModelConfig`` (names start with their component: ``language.*`` as the GPT, encoder ``layers.*`` as
    blocks of the encoder's shape, everything else replicated)."""
    if hasattr(cfg, "language"):
        component, _, rest = name.partition(".")
        if component == "language":
            return tp_partition(rest, cfg.language)
        if component in ("vision", "audio") and rest.startswith("layers."):
            return tp_partition(rest, getattr(cfg, component).block_config())
        return None
    hd = cfg.hidden_size // cfg.num_attention_heads
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return 0, (cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)
    if name.endswith(("mlp.up.weight", "mlp.up.bias")):
        return 0, (cfg.ffn_hidden_size, cfg.ffn_hidden_size) if cfg.activation == "swiglu" else None
    if name.endswith(("attn.proj.weight", "mlp.down.weight")):
        return 1, None
    if name in ("embed.weight", "output.weight"):
        return 0, None
    return None


def tp_shard_of(name: str, full: torch.Tensor, cfg, rank: int, n: int) -> torch.Tensor:
    """This TP rank's piece of the full tensor of parameter ``name``."""
    spec = tp_partition(name, cfg)
    if spec is None or n == 1:
        return full
    dim, parts = spec
    return _shard_parts(full, parts or (full.shape[dim],), rank, n, dim=dim)
