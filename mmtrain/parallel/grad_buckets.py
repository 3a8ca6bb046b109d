"""Data parallelism: fp32 gradient buckets reduced while backward runs (the optimizer that updates their shards is
``mmtrain.train.optimizer.MixedPrecisionAdamW``).

Layout (Megatron-Core's design, rewritten small):
- All trainable parameters of this rank live in one contiguous *param buffer* and their fp32 gradients in a
  *grad buffer* of the same layout, split into buckets in backward order. Each bucket is padded to a multiple
  of the data-parallel size so it splits evenly into per-rank shards.
- A post-accumulate-grad hook takes each ``p.grad`` (and frees ``p.grad``); a bucket's gradients are written into
  their ``p.main_grad`` (fp32: copied, or added after the step's first micro-batch) together, once all of them
  are in or when the backward ends (a callback the hook queues on the autograd engine): a few multi-tensor
  launches a bucket instead of one per parameter, which is host time the GPU waits for (a VLM has 534
  parameters). During the last micro-batch's backward, a bucket whose parameters are all done is reduced at once
  (async), overlapping communication with the rest of the backward: an all-reduce, or with the distributed
  optimizer a reduce-scatter so each rank receives only the shard it updates.
- Reductions are *sums*; the global loss-token count divides them after (the training loop has the optimizer's
  fused AdamW kernel divide, ``finish(None)``: no pass of its own over the gradients), which keeps any layout exactly
  equal to one process.

Parameters whose gradient must first be summed elsewhere (a tied embedding copy across pipeline stages) are put
in a final bucket that the trainer reduces after that sum (``late`` parameters).

``separate_params`` get buckets of their own whose all-gather an attached ``separate_gather`` replaces: the
precision layer's business, not this module's (``mmtrain.train.precision``: under ``fp8.param_gather`` the FP8
linears' weights, gathered in FP8 by ``mmtrain.model.fp8_param_gather``, while the other buckets are gathered in
the parameter dtype; docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.grad_accumulate import write_grads


@dataclass
class Bucket:
    params: list[nn.Parameter]
    start: int  # element offsets into the buffers
    end: int
    late: bool = False
    separate: bool = False  # holds only separate_params: gathered by the attached separate_gather
    pending: set[int] = field(default_factory=set)
    unwritten: set[int] = field(default_factory=set)  # this step's params with no gradient in main_grad yet
    arrived: list = field(default_factory=list)  # (main_grad, grad, first) of this backward, not written yet
    handle: object = None
    shard_grad: torch.Tensor | None = None  # reduce-scatter output (distributed optimizer)


class GradBuckets:
    """This rank's parameters in one contiguous buffer and their gradients in bucketed fp32 (or param-dtype)
    buffers, reduced over ``group`` as backward finishes (all-reduce, or reduce-scatter with the distributed
    optimizer). Per step: ``reset()``, ``last_backward()`` before the last micro-batch's backward, ``finish(n)``."""

    def __init__(self, params: list[nn.Parameter], group, distributed_optimizer: bool, param_dtype: torch.dtype,
                 bucket_elems: int = 40_000_000, late_params: list[nn.Parameter] = (), overlap: bool = True,
                 grad_dtype: torch.dtype = torch.float32, separate_params: list[nn.Parameter] = ()) -> None:
        """``separate_params``: put in buckets of their own (``Bucket.separate``), each padded to a multiple of
        16 x dp elements so that, in a one-byte copy of these buckets, every weight and every shard starts 16-byte
        aligned (what FP8 GEMMs need). Empty (the default): the layout does not change."""
        self.group = group
        self.dp = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.sharded = distributed_optimizer and self.dp > 1
        self.overlap = overlap
        late_ids = {id(p) for p in late_params}
        separate_ids = {id(p) for p in separate_params}
        ordered = [p for p in reversed(params) if id(p) not in late_ids]  # backward visits the last layers first
        groups: list[tuple[list[nn.Parameter], bool, bool]] = []  # (params, late, separate)
        current: dict[bool, list[nn.Parameter]] = {False: [], True: []}  # filled side by side: separate or not
        for p in ordered:
            kind = id(p) in separate_ids
            current[kind].append(p)
            if sum(q.numel() for q in current[kind]) >= bucket_elems:
                groups.append((current[kind], False, kind))
                current[kind] = []
        groups += [(current[kind], False, kind) for kind in (False, True) if current[kind]]
        late = [p for p in params if id(p) in late_ids]
        if late:
            groups.append((late, True, False))
        self.buckets: list[Bucket] = []
        offset = 0
        for plist, is_late, is_separate in groups:
            n = sum(p.numel() for p in plist)
            multiple = self.dp * (16 if is_separate else 1)
            padded = -(-n // multiple) * multiple
            self.buckets.append(Bucket(plist, offset, offset + padded, is_late, is_separate))
            offset += padded
        device = self.device = params[0].device
        self.grad_buffer = torch.zeros(offset, dtype=grad_dtype, device=device)
        self.param_buffer = torch.zeros(offset, dtype=param_dtype, device=device)
        self.bucket_of: dict[int, Bucket] = {}
        for b in self.buckets:
            pos = b.start
            for p in b.params:
                n = p.numel()
                self.param_buffer[pos:pos + n].copy_(p.data.reshape(-1))
                p.data = self.param_buffer[pos:pos + n].view_as(p)
                p.main_grad = self.grad_buffer[pos:pos + n].view_as(p)
                p.buffer_offset = pos
                self.bucket_of[id(p)] = b
                pos += n
            if self.sharded:
                b.shard_grad = torch.zeros((b.end - b.start) // self.dp, dtype=grad_dtype, device=device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # gather() after the optimizer step instead of the separate buckets' all-gather, gather_full() when whole
        # values are needed (set by e.g. mmtrain.model.fp8_param_gather.Fp8ParamGather)
        self.separate_gather = None
        self.sync_now = False
        self.reset()

    # ------------------------------------------------------------------------------------------ backward
    def reset(self) -> None:
        """Before a step: arm every bucket. The gradients are not zeroed here: a parameter's first gradient of
        the step is copied into its ``main_grad`` and later ones added (a zeroing pass and a read of zeros saved:
        8 bytes per parameter per step in fp32); one that got none is zeroed before its bucket is reduced. The
        padding between parameters is never written, so it stays zero."""
        self.sync_now = False
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}
            b.unwritten = set(b.pending)
            b.arrived = []
            b.handle = None
        self._next_launch = 0
        self._write_task = None  # the backward (autograd graph task) whose end writes what arrived

    def last_backward(self) -> None:
        """Call before the backward of the step's last micro-batch: ready buckets are reduced from then on."""
        self.sync_now = True

    def _on_grad(self, p: nn.Parameter) -> None:
        key = id(p)
        b = self.bucket_of[key]
        b.arrived.append((p.main_grad, p.grad, key in b.unwritten))
        b.unwritten.discard(key)
        p.grad = None
        task = torch._C._current_graph_task_id()
        if task != self._write_task:  # this backward's first gradient: write the rest when it ends
            self._write_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._write_arrived)
        if len(b.arrived) == len(b.params):  # the bucket is complete: written now, before its reduction
            self._write(b)
        if self.sync_now:
            b.pending.discard(key)
            if not b.pending and self.overlap:
                self._launch_ready()

    def _write_arrived(self) -> None:
        """At the end of a backward: write the gradients of the buckets not yet complete (parameters that got
        no gradient in this micro-batch, e.g. a vision tower's on text-only rows)."""
        for b in self.buckets:
            self._write(b)

    @staticmethod
    @torch.no_grad()
    def _write(b: Bucket) -> None:
        if b.arrived:
            write_grads(b.arrived)
            b.arrived = []

    def _launch_ready(self) -> None:
        """Launch the ready buckets in bucket order, stopping at the first one still waiting for a gradient. Every
        rank so issues its reductions in the same order, also when a parameter gets no gradient on some ranks
        (a VLM's vision tower on a micro-batch of text rows): a bucket that is ready on one rank only waits."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.pending or b.late:
                return
            self._launch(b)
            self._next_launch += 1

    def launch_pending(self) -> None:
        """After the step's backward, before any other collective: launch every bucket not launched yet, in
        order (those that waited for a gradient that never came on this rank). Late buckets wait for ``finish``:
        their tied gradients are summed over the pipeline stages first."""
        for b in self.buckets:
            if b.late:
                self._zero_unwritten(b)  # the tied gradients are summed before these launch
            else:
                self._launch(b)

    @staticmethod
    def _zero_unwritten(b: Bucket) -> None:
        """Zero the gradients of ``b``'s parameters that got none this step (their ``main_grad`` holds the last
        step's)."""
        if b.unwritten:
            for p in b.params:
                if id(p) in b.unwritten:
                    p.main_grad.zero_()
            b.unwritten.clear()

    def _launch(self, b: Bucket) -> None:
        if b.handle is not None:
            return
        self._write(b)
        self._zero_unwritten(b)
        view = self.grad_buffer[b.start:b.end]
        if self.dp == 1:
            b.handle = _Done()
        elif self.sharded:
            b.handle = dist.reduce_scatter_tensor(b.shard_grad, view, group=self.group, async_op=True)
        else:
            b.handle = dist.all_reduce(view, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self, num_tokens: float | torch.Tensor | None) -> None:
        """Reduce what is left (late buckets included), wait for all, scale by 1 / num_tokens (``None``: leave the
        sums; the caller divides). ``num_tokens`` may be a 0-dim device tensor: the scale then stays on the
        device, no host sync."""
        for b in self.buckets:
            self._launch(b)
        for b in self.buckets:
            b.handle.wait()
        if num_tokens is None:
            return
        # per bucket (bucket-sized views: one multi-tensor kernel, no index beyond 2**31 elements in it)
        scale_grads([b.shard_grad if self.sharded else self.grad_buffer[b.start:b.end] for b in self.buckets],
                    num_tokens)

    # ----------------------------------------------------------------------------------------- shards
    def owned_range(self, b: Bucket) -> tuple[int, int]:
        """Buffer range this rank updates in bucket ``b`` (the whole bucket without the distributed optimizer)."""
        if not self.sharded:
            return b.start, b.end
        size = (b.end - b.start) // self.dp
        return b.start + self.dp_rank * size, b.start + (self.dp_rank + 1) * size

    def reduced_grad(self, b: Bucket, start: int, end: int) -> torch.Tensor:
        """The reduced fp32 gradient of buffer range [start, end) inside this rank's owned range of ``b``."""
        if not self.sharded:
            return self.grad_buffer[start:end]
        own_start, _ = self.owned_range(b)
        return b.shard_grad[start - own_start:end - own_start]

    def param_values(self, b: Bucket, start: int, end: int) -> torch.Tensor:
        """The parameter values of buffer range [start, end) of bucket ``b`` (what the optimizer updates)."""
        return self.param_buffer[start:end]

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer updated this rank's shards: every rank gets every updated parameter. With a
        ``separate_gather`` attached, it gathers the separate buckets instead (FP8: in FP8 into the FP8 weight
        copies), and their parameter-dtype values may stay stale on the ranks that do not own them until
        ``gather_full_params``."""
        if not self.sharded:
            return
        for b in self.buckets:
            if not (b.separate and self.separate_gather is not None):
                self.gather_bucket(b)
        if self.separate_gather is not None:
            self.separate_gather.gather()

    @torch.no_grad()
    def gather_bucket(self, b: Bucket) -> None:
        """All-gather bucket ``b`` of the parameter buffer from its owners."""
        full = self.param_buffer[b.start:b.end]
        own_start, own_end = self.owned_range(b)
        shard = self.param_buffer[own_start:own_end].clone()
        dist.all_gather_into_tensor(full, shard, group=self.group)

    def gather_full_params(self) -> None:
        """Make every parameter's value whole on this rank (collective): after a ``separate_gather`` (FP8
        parameter gathers), the separate buckets in the parameter dtype. Called before anything reads the weights
        (checkpoint save, end of run)."""
        if self.separate_gather is not None:
            self.separate_gather.gather_full()

    def params_loaded(self) -> None:
        """After a checkpoint load wrote the parameters: nothing to do (they are the buffer itself)."""

    def release_full_params(self) -> None:
        """After reading the whole weights: nothing to free (the parameters stay whole; FP8-gathered weights'
        BF16 values are current until the next optimizer step)."""


def scale_grads(grads: list[torch.Tensor], num_tokens: float | torch.Tensor) -> None:
    """``grads`` (tensors of one dtype: bucket-sized views) *= 1 / num_tokens. A device count's scale is made a
    0-dim tensor of the gradients' own dtype and applied by one multi-tensor kernel: on CUDA, ``mul_`` by a 0-dim
    device tensor is not vectorised (and casts every element when the dtypes differ), and ``_foreach_mul_`` by
    a scalar of another dtype falls back to one such kernel per tensor. (Reading CUDA's casting kernel, it
    rounded a float64 scale to the gradients' dtype already; the CPU now does the same.)"""
    if not grads:
        return
    if isinstance(num_tokens, torch.Tensor):
        torch._foreach_mul_(grads, (1.0 / num_tokens).to(grads[0].dtype))
    else:
        torch._foreach_mul_(grads, 1.0 / num_tokens)


class _Done:
    def wait(self) -> None:
        pass
