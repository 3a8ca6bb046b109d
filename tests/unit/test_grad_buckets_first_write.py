"""``GradBuckets`` copies a parameter's first gradient of a step into its ``main_grad`` and adds later ones, with
no zeroing pass (issue #32: 8 bytes per parameter per step less); a parameter that gets no gradient in a step
must then read zero, not the last step's value. Checked on two ranks, all-reduce and reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.testing import run_distributed


def _steps(rank: int, world_size: int, sharded: bool):
    """Per step, {name: (bucket index, offset in bucket, numel)} and this rank's reduced bucket gradients."""
    used, unused = nn.Parameter(torch.ones(6)), nn.Parameter(torch.ones(4))
    buckets = GradBuckets([used, unused], dist.group.WORLD, sharded, torch.float32, bucket_elems=4)
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


@pytest.mark.parametrize("sharded", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_first_gradient_copied_later_added_and_missing_ones_zero(sharded):
    (where, seen0), (_, seen1) = run_distributed(_steps, 2, sharded)
    # gradient scale (rank + 2 + step) summed over ranks 0 and 1: step 0 -> 5; step 1, two micro-batches ->
    # 2 * (3 + 4) = 14. `unused`: 3 on each rank at step 0, no gradient at step 1 (its step-0 value must not stay)
    expect = [{"used": 5.0, "unused": 6.0}, {"used": 14.0, "unused": 0.0}]
    for step in range(2):
        whole = [torch.cat([a, b]) if sharded else a for a, b in zip(seen0[step], seen1[step])]
        for name, (bucket, offset, numel) in where.items():
            assert torch.equal(whole[bucket][offset:offset + numel], torch.full((numel,), expect[step][name])), \
                (step, name)
