"""``GradBuckets`` copies a parameter's first gradient of a step into its ``main_grad`` and adds later ones, with
no zeroing pass (issue #32: 8 bytes per parameter per step less); a parameter that gets no gradient in a step
must then read zero, not the last step's value. Checked on two ranks, all-reduce and reduce-scatter, with a
bucket per parameter and with both in one bucket (whose gradients are then written when the backward ends, the
bucket never complete at step 1). And the writes are multi-tensor calls: the host's launches a step do not grow
with the parameter count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.testing import run_distributed


def _steps(rank: int, world_size: int, sharded: bool, bucket_elems: int):
    """Per step, {name: (bucket index, offset in bucket, numel)} and this rank's reduced bucket gradients."""
    used, unused = nn.Parameter(torch.ones(6)), nn.Parameter(torch.ones(4))
    buckets = GradBuckets([used, unused], dist.group.WORLD, sharded, torch.float32, bucket_elems=bucket_elems)
    where = {name: next((i, p.buffer_offset - b.start, p.numel()) for i, b in enumerate(buckets.buckets)
                        if any(q is p for q in b.params)) for name, p in [("used", used), ("unused", unused)]}
    seen = []
    for step, micro_batches in enumerate([[True], [False, False]]):  # step 0: both get gradients; 1: `used` only
        buckets.reset()
        for i, with_unused in enumerate(micro_batches):
            if i == len(micro_batches) - 1:
                buckets.last_backward()
            loss = (used * (rank + 2.0 + step)).sum() + ((unused * 3.0).sum() if with_unused else 0.0)
            loss.backward()
        buckets.launch_pending()
        buckets.finish(1.0)
        seen.append([(b.shard_grad if buckets.sharded else buckets.grad_buffer[b.start:b.end]).clone()
                     for b in buckets.buckets])
    return where, seen


@pytest.mark.parametrize("bucket_elems", [4, 100], ids=["bucket_each", "one_bucket"])
@pytest.mark.parametrize("sharded", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_first_gradient_copied_later_added_and_missing_ones_zero(sharded, bucket_elems):
    (where, seen0), (_, seen1) = run_distributed(_steps, 2, sharded, bucket_elems)
    # gradient scale (rank + 2 + step) summed over ranks 0 and 1: step 0 -> 5; step 1, two micro-batches ->
    # 2 * (3 + 4) = 14. `unused`: 3 on each rank at step 0, no gradient at step 1 (its step-0 value must not stay)
    expect = [{"used": 5.0, "unused": 6.0}, {"used": 14.0, "unused": 0.0}]
    for step in range(2):
        whole = [torch.cat([a, b]) if sharded else a for a, b in zip(seen0[step], seen1[step])]
        for name, (bucket, offset, numel) in where.items():
            assert torch.equal(whole[bucket][offset:offset + numel], torch.full((numel,), expect[step][name])), \
                (step, name)


def _op_counts(rank: int, world_size: int, n_params: int):
    """aten ops (by name) of one micro-batch's gradient writes (inside backward) and of one optimizer step, with
    ``n_params`` parameters in one bucket and fp32 masters of bf16 weights."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mmtrain.train.optimizer import MixedPrecisionAdamW

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    params = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(n_params)]
    buckets = GradBuckets(params, dist.group.WORLD, False, torch.bfloat16)
    opt = MixedPrecisionAdamW([buckets], 1e-3, (0.9, 0.95), 1e-8, 0.0)
    loss = sum((p.float() * (i + 1)).sum() for i, p in enumerate(params))
    buckets.reset()
    buckets.last_backward()
    with Count() as in_backward:
        loss.backward()
    buckets.launch_pending()
    buckets.finish(1.0)
    expect = torch.arange(1, n_params + 1, dtype=torch.float32)
    assert torch.equal(torch.stack([p.main_grad[0] for p in params]), expect)
    with Count() as in_step:
        opt.step()
    return in_backward.ops, in_step.ops


def test_gradient_writes_and_weight_copies_are_multi_tensor_calls():
    (few_bw, few_step), = run_distributed(_op_counts, 1, 4)
    (many_bw, many_step), = run_distributed(_op_counts, 1, 40)
    writes = {name: few_bw.get(name, 0) for name in ("_foreach_copy_", "copy_", "add_")}
    assert writes == {"_foreach_copy_": 1, "copy_": 0, "add_": 0}, few_bw
    for name in ("_foreach_copy_", "copy_", "add_", "_fused_adamw_"):
        assert many_bw.get(name, 0) == few_bw.get(name, 0) and many_step.get(name, 0) == few_step.get(name, 0), \
            (name, few_bw, many_bw, few_step, many_step)
    assert few_step.get("_foreach_copy_") == 1 and few_step.get("copy_", 0) == 0, few_step
