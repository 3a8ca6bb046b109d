"""ParallelMesh over real gloo process groups, and the harness itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmtrain.parallel import GROUP_NAMES, ParallelDims
from mmtrain.testing import DistributedTestFailure, run_distributed


def _check_groups(rank: int, world_size: int, sizes: dict) -> dict:
    dims = ParallelDims(world_size=world_size, **sizes)
    mesh = dims.build()
    assert mesh.coord == dims.coord(rank)
    sums = {}
    for name in GROUP_NAMES:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(name))
        assert t.item() == sum(mesh.ranks(name)), (name, mesh.ranks(name), t.item())
        assert dist.get_world_size(mesh.group(name)) == dims.size(name)
        assert mesh.ranks(name)[mesh.local_rank(name)] == rank
        sums[name] = t.item()
    return sums


@pytest.mark.parametrize("world_size, sizes", [
    (4, dict(tp=2, dp=2)),
    (8, dict(tp=2, pp=2, dp=2)),
    (8, dict(cp=2, dp=4, ep=4)),
])
def test_groups_reduce_over_their_members(world_size, sizes):
    results = run_distributed(_check_groups, world_size, sizes)
    assert len(results) == world_size


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    print(f"rank {rank} says hello")  # goes to the rank's captured output, not the terminal
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the healthy rank would hang here without the harness's kill


def test_harness_surfaces_the_failing_rank_traceback_and_output(capfd):
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1 of 2 failed:.*ValueError: boom on purpose.*"
                       r"the rank's output.*rank 1 says hello"):
        run_distributed(_fails_on_rank_one, 2, timeout_s=60)
    assert "says hello" not in "".join(capfd.readouterr())  # ranks' output stays out of the test's


def _returns_rank(rank: int, world_size: int, scale: int) -> int:
    return rank * scale


def test_harness_returns_values_in_rank_order():
    assert run_distributed(_returns_rank, 3, 10) == [0, 10, 20]
