"""ParallelDims arithmetic over every factorization of world sizes 1..8 (no processes needed)."""

from __future__ import annotations

import pytest

from mmtrain.parallel.dims import GROUP_NAMES, LayoutError, ParallelDims, factorizations


def _layouts():
    for ws in range(1, 9):
        for tp, pp, cp, dp in factorizations(ws):
            for ep in range(1, dp * cp + 1):
                if (dp * cp) % ep == 0:
                    yield ParallelDims(world_size=ws, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)


LAYOUTS = list(_layouts())


def test_every_factorization_is_enumerated():
    # world 8: ordered 4-factorizations of 2^3 = C(3+3, 3) = 20
    assert len(factorizations(8)) == 20
    assert len(factorizations(1)) == 1
    assert all(tp * pp * cp * dp == 6 for tp, pp, cp, dp in factorizations(6))


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: d.describe().replace(" ", ","))
def test_layout_invariants(dims: ParallelDims):
    ws = dims.world_size
    # rank <-> coordinate round trip, and coordinates are unique
    seen = set()
    for r in range(ws):
        c = dims.coord(r)
        assert dims.rank(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r
        assert (c.tp, c.cp, c.dp, c.pp) not in seen
        seen.add((c.tp, c.cp, c.dp, c.pp))
        assert c.ep == (c.cp + dims.cp * c.dp) % dims.ep
        assert c.edp == (c.cp + dims.cp * c.dp) // dims.ep
    for name in GROUP_NAMES:
        groups = dims.group_ranks(name)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(ws)), f"{name} groups must cover the world exactly once"
        assert all(len(g) == dims.size(name) for g in groups), name
        assert len(groups) * dims.size(name) == ws
        for g in groups:
            coords = [dims.coord(r) for r in g]
            varying = {f for f in ("tp", "cp", "dp", "pp", "ep", "edp")
                       if len({getattr(c, f) for c in coords}) > 1}
            allowed = {"tp": {"tp"}, "cp": {"cp", "ep", "edp"}, "dp": {"dp", "ep", "edp"},
                       "dp_cp": {"dp", "cp", "ep", "edp"}, "pp": {"pp"}, "ep": {"dp", "cp", "ep"},
                       "edp": {"dp", "cp", "edp"}, "mp": {"tp", "pp"}}[name]
            assert varying <= allowed, (name, g, varying)
            if name == "ep":
                assert sorted(c.ep for c in coords) == list(range(dims.ep))
            if name == "edp":
                assert sorted(c.edp for c in coords) == list(range(dims.edp))


def test_tp_peers_are_neighbours():
    dims = ParallelDims(world_size=8, tp=2, pp=2, dp=2)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_groups_tile_dp_cp():
    dims = ParallelDims(world_size=8, dp=4, cp=2, ep=4)
    assert dims.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.edp == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=3), "tp*pp*cp*dp = 3*1*1*1 = 3 does not equal the world size 8"),
    (dict(world_size=4, tp=2, dp=2, ep=4), "parallel.ep (4) must divide dp*cp = 2*1 = 2"),
    (dict(world_size=2, tp=0, dp=2), "parallel.tp must be a positive integer, got 0"),
])
def test_misconfiguration_names_sizes(kwargs, message):
    with pytest.raises(LayoutError, match=__import__("re").escape(message)):
        ParallelDims(**kwargs)


def test_infer_dp_and_errors():
    assert ParallelDims.infer(8, tp=2, pp=2).dp == 2
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        ParallelDims.infer(6, tp=4)
    with pytest.raises(LayoutError, match="rank 8 outside world of size 8"):
        ParallelDims.infer(8).coord(8)
    with pytest.raises(KeyError, match="unknown group 'xx'"):
        ParallelDims.infer(2).group_ranks("xx")
