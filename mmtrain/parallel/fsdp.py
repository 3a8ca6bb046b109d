"""Fully sharded data parallelism (``parallel.fsdp``, ZeRO-3) on the distributed optimizer's buckets.

``FsdpBuckets`` has ``GradBuckets``' interface (what ``MixedPrecisionAdamW``, gradient finalization and the
checkpoint code call) with a different memory layout:

- every *unit* (a transformer block's parameters of this reduction group) is one bucket, padded to a multiple of
  dp. A rank keeps only its owned 1/dp shard of the bucket's values (``shard_param``) and of its reduced fp32
  gradient (``shard_grad``) between uses;
- the bucket's full values (``full_param``, which the parameters are views of) are all-gathered just before the
  block's forward and freed after it (the storage resized to 0 bytes: the views stay, their bytes go); the next
  block's gather is started asynchronously meanwhile (prefetch). Backward gathers again when the block's output
  gradient arrives (a tensor hook) and prefetches the block before it;
- gradients: each micro-batch, once every parameter of a unit has its gradient, the unit's full-size gradient is
  made from them in one multi-tensor copy (``_full_grad``), reduce-scattered (summed, asynchronously, at most two
  in flight) into the owned fp32 shard, and the full-size gradient and values are freed. ``finish`` waits for
  all (and scales by 1 / tokens, unless given None) as ``GradBuckets`` does;
- the parameters outside blocks (embedding, final norm, output layer, and a tied embedding's copy: the *late*
  bucket, summed over the first/last stage before its reduction) stay whole on every rank, as with the
  distributed optimizer: they are one resident bucket, reduced in ``finish``, all-gathered after the step.

A unit may have a second bucket (``separate_params``) whose gather for use an attached ``separate_gather``
does instead (the FP8 weights, gathered in FP8: ``mmtrain.model.fp8_fsdp``). ``trainable=False`` shards a
frozen model (the DPO reference): gathered and freed the same way, no gradients.

Activation recompute re-runs a block's forward inside its backward, after the backward gather: the module hooks
do not fire there (the recompute calls the block's inner forward), so nothing is freed under it. Parallelism over
TP/PP/CP needs nothing more: a rank's parameters are its TP shard of its stage. Why not ``torch.distributed.fsdp``'s
``fully_shard``: it wants DTensor parameters, its own optimizer-state layout and its own gradient reduction,
while mmtrain's TP modules hold plain local tensors, the optimizer works on flat bucket ranges, and checkpoints
store those ranges as boxes of global tensors (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.grad_accumulate import write_grad, write_grads
from mmtrain.parallel.grad_buckets import Bucket, scale_grads


@dataclass
class _Unit(Bucket):
    """A bucket with its own storage: the owned shards persistent; for a unit (``is_unit``) the full values and
    gradient exist only while used, for a resident bucket always."""

    is_unit: bool = True
    full_param: torch.Tensor | None = None  # the parameters are views of it; 0 bytes while freed
    shard_param: torch.Tensor | None = None  # this rank's owned values (what the optimizer updates)
    full_grad: torch.Tensor | None = None  # a resident bucket's full-size gradient (a unit's: while reduced)
    gathered: bool = True
    gather_handle: object = None  # an all-gather in flight (a prefetch)
    pos: dict[int, int] = field(default_factory=dict)  # id(param) -> element offset inside the bucket


class FsdpBuckets:
    """``units``: lists of parameters (one per block, in forward order) gathered and freed together; ``modules``:
    the module of each unit (hooks go on it); ``resident``: the other parameters, whole on every rank."""

    def __init__(self, units: list[list[nn.Parameter]], modules: list[nn.Module], resident: list[nn.Parameter],
                 group, param_dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32,
                 late_params: list[nn.Parameter] = (), separate_params: list[nn.Parameter] = (),
                 trainable: bool = True) -> None:
        """``trainable=False``: frozen parameters (a DPO reference model): only gathered and freed, no gradients
        (``reset``/``finish`` and the optimizer are not for it). ``separate_params``: the parameters of a unit
        listed here form a second bucket of that unit (``Bucket.separate``, padded to 16 x dp elements so a
        one-byte copy keeps every weight and shard 16-byte aligned); with a ``separate_gather`` attached it, not
        this class, gathers them for use (FP8 weights gathered in FP8: ``mmtrain.model.fp8_fsdp``) and their own
        values are gathered only by ``gather_full_params``."""
        self.group = group
        self.dp = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.sharded = True  # every rank owns a distinct shard of every bucket (dp == 1: the whole bucket)
        self.separate_gather = None
        late_ids, separate_ids = {id(p) for p in late_params}, {id(p) for p in separate_params}
        groups = []  # (params, late, is_unit, separate, index of the unit's module)
        for i, u in enumerate(units):
            groups += [(part, False, True, sep, i) for sep in (False, True)
                       if (part := [p for p in u if (id(p) in separate_ids) == sep])]
        groups.append(([p for p in resident if id(p) not in late_ids], False, False, False, None))
        groups.append(([p for p in resident if id(p) in late_ids], True, False, False, None))
        self.device = next(p.device for g, *_ in groups for p in g)
        self.buckets: list[Bucket] = []
        self.units: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        by_module: dict[int, list[Bucket]] = {}  # a unit's buckets (its own values, its separate ones)
        offset = 0
        for plist, late, is_unit, separate, module_index in groups:
            if not plist:
                continue
            n = sum(p.numel() for p in plist)
            multiple = self.dp * (16 if separate else 1)
            padded = -(-n // multiple) * multiple
            b = _Unit(plist, offset, offset + padded, late, separate, is_unit=is_unit,
                      full_param=torch.zeros(padded, dtype=param_dtype, device=self.device),
                      shard_grad=torch.zeros(padded // self.dp if trainable else 0, dtype=grad_dtype,
                                             device=self.device))
            pos = 0
            for p in plist:
                b.full_param[pos:pos + p.numel()].copy_(p.data.reshape(-1))
                p.data = b.full_param[pos:pos + p.numel()].view_as(p)
                p.buffer_offset = offset + pos
                b.pos[id(p)] = pos
                self.bucket_of[id(p)] = b
                pos += p.numel()
            lo = self.dp_rank * (padded // self.dp)
            b.shard_param = b.full_param[lo:lo + padded // self.dp].clone()
            if not is_unit and trainable:  # resident: a persistent full-size gradient, reduced in finish
                b.full_grad = torch.zeros(padded, dtype=grad_dtype, device=self.device)
                for p in plist:
                    p.main_grad = b.full_grad[b.pos[id(p)]:b.pos[id(p)] + p.numel()].view_as(p)
            self.buckets.append(b)
            if is_unit:  # freed at once: a build holds at most one unit twice
                self.units.append(b)
                by_module.setdefault(module_index, []).append(b)
                self._free(b)
            offset += padded
        self.grad_dtype = grad_dtype
        self._in_flight: list = []  # unit reduce-scatters not yet added into their shards (_reduce_unit)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g, *_ in groups for p in g
                       if trainable]
        # units are in forward order: the next one is prefetched in forward, the previous one in backward
        order = sorted(by_module)
        for i, index in enumerate(order):
            nxt = by_module[order[i + 1]] if i + 1 < len(order) else []
            prev = by_module[order[i - 1]] if i > 0 else []
            self._hooks.append(modules[index].register_forward_pre_hook(self._pre_forward(by_module[index], nxt)))
            self._hooks.append(modules[index].register_forward_hook(self._post_forward(by_module[index], prev)))
        if trainable:
            self.reset()

    # ------------------------------------------------------------------------------------- gather / free
    def _storage_bytes(self, b: Bucket) -> int:
        return b.full_param.numel() * b.full_param.element_size()

    def _gathered_by_other(self, b: Bucket) -> bool:
        return b.separate and self.separate_gather is not None

    @torch.no_grad()
    def _start_gather(self, b: Bucket) -> None:
        """Start gathering a unit for use (async). Its ``gathered`` means: ready for the block's compute."""
        if b.gathered or b.gather_handle is not None:
            return
        if self._gathered_by_other(b):
            b.gather_handle = self.separate_gather.start_unit(b)
            return
        b.full_param.untyped_storage().resize_(self._storage_bytes(b))
        b.gather_handle = dist.all_gather_into_tensor(b.full_param, b.shard_param, group=self.group, async_op=True)

    def _gather(self, b: Bucket) -> None:
        self._start_gather(b)
        if b.gather_handle is not None:
            b.gather_handle.wait()
            b.gather_handle = None
            if self._gathered_by_other(b):
                self.separate_gather.finish_unit(b)
        b.gathered = True

    def _free(self, b: Bucket) -> None:
        if b.gather_handle is not None:  # a prefetch nobody used (e.g. the last block's next)
            b.gather_handle.wait()
            b.gather_handle = None
        if self._gathered_by_other(b):
            self.separate_gather.free_unit(b)
        b.full_param.untyped_storage().resize_(0)  # (separate: whole only after gather_full_params)
        b.gathered = False

    def _pre_forward(self, parts: list[Bucket], nxt: list[Bucket]):
        def hook(module, args):
            for b in parts:
                self._start_gather(b)  # both of a unit's buckets in flight at once
            for b in parts:
                self._gather(b)
            for b in nxt:
                self._start_gather(b)  # overlaps this block's forward
        return hook

    def _post_forward(self, parts: list[Bucket], prev: list[Bucket]):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                def before_backward(grad):
                    for b in parts:
                        self._start_gather(b)
                    for b in parts:
                        self._gather(b)
                    for b in prev:
                        self._start_gather(b)  # overlaps this block's backward
                    return grad
                out.register_hook(before_backward)
            for b in parts:
                self._free(b)
        return hook

    # ------------------------------------------------------------------------------------------- grads
    def reset(self) -> None:
        """Before a step: zero the owned gradient shards (and the resident full gradients)."""
        for b in self.buckets:
            b.shard_grad.zero_()
            if not b.is_unit:
                b.full_grad.zero_()
            b.pending = {id(p) for p in b.params}
            b.arrived = []

    def last_backward(self) -> None:
        """Units are reduced every micro-batch: nothing changes for the last one."""

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        b = self.bucket_of[id(p)]
        if not b.is_unit:
            write_grad(p.main_grad, p.grad, first=False)  # on CUDA a vectorised kernel (grad_accumulate)
            p.grad = None
            return
        b.arrived.append((b.pos[id(p)], p.grad.reshape(-1)))
        p.grad = None
        b.pending.discard(id(p))
        if not b.pending:  # the unit's backward is done for this micro-batch
            self._reduce_unit(b)
            b.pending = {id(q) for q in b.params}
            self._free(b)

    def _full_grad(self, b: Bucket) -> torch.Tensor:
        """The unit's full-size gradient from the gradients that arrived: written together (one multi-tensor copy
        of each parameter's first, ``grad_accumulate.write_grads``) into uninitialized memory, not added one launch
        a parameter into zeros; what no gradient covers (the padding; parameters that got none) is zeroed."""
        full = torch.empty(b.end - b.start, dtype=self.grad_dtype, device=self.device)
        covered, writes = set(), []
        for pos, grad in b.arrived:
            writes.append((full[pos:pos + grad.numel()], grad, pos not in covered))
            covered.add(pos)
        b.arrived = []
        used = sum(q.numel() for q in b.params)
        if len(covered) < len(b.params):  # some parameter got no gradient: zeros under everything first
            full.zero_()
        elif used < full.numel():
            full[used:].zero_()
        write_grads(writes)
        return full

    def _reduce_unit(self, b: Bucket) -> None:
        """Reduce-scatter the unit's full gradient (async: it overlaps the next blocks' backward); at most two
        are in flight, the oldest is added into its owned shard and its full gradient dropped when a third starts."""
        b.full_grad = self._full_grad(b)
        out = torch.empty_like(b.shard_grad)
        handle = dist.reduce_scatter_tensor(out, b.full_grad, group=self.group, async_op=True)
        self._in_flight.append((b, out, b.full_grad, handle))
        b.full_grad = None
        while len(self._in_flight) > 2:
            self._land_oldest()

    def _land_oldest(self) -> None:
        b, out, _full, handle = self._in_flight.pop(0)  # _full: kept alive until the collective is done
        handle.wait()
        b.shard_grad.add_(out)

    @torch.no_grad()
    def launch_pending(self) -> None:
        """Nothing: the fully sharded units are reduced per micro-batch as their gradients arrive (the bucket
        interface's hook for GradBuckets, which launches its waiting reductions here)."""

    def finish(self, num_tokens: float | torch.Tensor | None) -> None:
        """Reduce what is left (units some of whose parameters got no gradient, the resident buckets), scale by
        1 / num_tokens (``None``: the caller divides; ``GradBuckets.finish``), free every unit."""
        for b in self.buckets:
            if b.is_unit:
                if b.arrived:
                    self._reduce_unit(b)
                    b.pending = {id(q) for q in b.params}
                self._free(b)
            else:
                dist.reduce_scatter_tensor(b.shard_grad, b.full_grad, group=self.group)
        while self._in_flight:
            self._land_oldest()
        if num_tokens is not None:
            scale_grads([b.shard_grad for b in self.buckets], num_tokens)

    # ------------------------------------------------------------------------------------------ shards
    def owned_range(self, b: Bucket) -> tuple[int, int]:
        size = (b.end - b.start) // self.dp
        return b.start + self.dp_rank * size, b.start + (self.dp_rank + 1) * size

    def reduced_grad(self, b: Bucket, start: int, end: int) -> torch.Tensor:
        own_start, _ = self.owned_range(b)
        return b.shard_grad[start - own_start:end - own_start]

    def param_values(self, b: Bucket, start: int, end: int) -> torch.Tensor:
        """This rank's persistent values of buffer range [start, end) inside its owned range of ``b``."""
        own_start, _ = self.owned_range(b)
        return b.shard_param[start - own_start:end - own_start]

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer step: the resident buckets whole again (units are gathered when used)."""
        for b in self.buckets:
            if not b.is_unit:
                b.gathered = False
                b.gather_handle = dist.all_gather_into_tensor(b.full_param, b.shard_param, group=self.group,
                                                              async_op=True)
                self._gather(b)
        if self.separate_gather is not None:  # e.g. the FP8 shards cast from the updated values
            self.separate_gather.gather()

    @torch.no_grad()
    def gather_full_params(self) -> None:
        """Collective: every unit whole on this rank (checkpoint save and load, end of run); the next forward
        frees each unit again after using it."""
        for b in self.units:
            if self._gathered_by_other(b):  # its own values, whatever the attached gather keeps for use
                b.full_param.untyped_storage().resize_(self._storage_bytes(b))
                dist.all_gather_into_tensor(b.full_param, b.shard_param, group=self.group)
            else:
                self._gather(b)

    @torch.no_grad()
    def params_loaded(self) -> None:
        """After new values were written into the whole parameters (a checkpoint load, after
        ``gather_full_params``): take this rank's shards from them."""
        for b in self.buckets:
            size = (b.end - b.start) // self.dp
            b.shard_param.copy_(b.full_param[self.dp_rank * size:(self.dp_rank + 1) * size])
        if self.separate_gather is not None:
            self.separate_gather.params_loaded()

    def release_full_params(self) -> None:
        """After reading the whole weights (``gather_full_params``, e.g. for greedy samples): free every unit
        again now rather than at its next forward."""
        for b in self.units:
            self._free(b)

    def resident_param_bytes(self) -> int:
        """Bytes this rank holds for parameter values now (shards, whole resident buckets, gathered units)."""
        total = 0
        for b in self.buckets:
            total += b.shard_param.numel() * b.shard_param.element_size()
            total += b.full_param.untyped_storage().nbytes()
        return total
