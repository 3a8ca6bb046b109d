"""Token dispatch strategies (mmtrain.parallel.moe_dispatch): the local dispatch equals a per-token reference;
the EP2 all-to-all dispatch — exact and padded splits, with and without the shared expert overlapped — gives
the one-process outputs and gradients, each rank building only its experts; a layer built with the wrong
dispatch is refused by the EP plan. The overlapped backward (shared experts' backward inside the combine
exchange's) is bit-equal to the plain one, also under recompute, and really starts the exchange before the
shared-expert gradients (recorded order); permute/unpermute move the hidden-size rows once each way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmtrain.config.schema import ModelConfig
from mmtrain.model.moe import MoELayer
from mmtrain.parallel.expert import apply_expert_parallel, expert_dispatch
from mmtrain.parallel.moe_dispatch import LocalDispatch
from mmtrain.testing import run_distributed

SHAPES = {  # (hidden, expert FFN): aligned rows take the grouped GEMM, odd ones the per-expert loop
    "grouped": (16, 8),
    "loop": (12, 6),
}


def _cfg(hidden: int, ffn: int, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=hidden, ffn_hidden_size=2 * ffn, moe_ffn_hidden_size=ffn, num_experts=4,
                       moe_top_k=2, num_attention_heads=2, activation="swiglu", add_bias=False, **kw)


def _layer(cfg: ModelConfig, dispatch=None) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(cfg, dispatch)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _reference(layer: MoELayer, x_ND: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert (no sorting), as the routing weights say."""
    weights, ids, _, _ = layer.router(x_ND)
    e = layer.experts
    out = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (x_ND[n] @ e.w_up[ids[n, k]]).chunk(2)
            out[n] += weights[n, k] * ((torch.nn.functional.silu(gate) * up) @ e.w_down[ids[n, k]])
    return out + (layer.shared(x_ND) if layer.shared is not None else 0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shared", [0, 8])
def test_local_dispatch_equals_per_token_reference(shape, shared):
    layer = _layer(_cfg(*SHAPES[shape], moe_shared_ffn_hidden_size=shared))
    x = torch.randn(2, 5, SHAPES[shape][0])
    torch.testing.assert_close(layer(x), _reference(layer, x.view(-1, x.shape[-1])).view_as(x),
                               rtol=1e-5, atol=1e-5)


def test_capacity_keeps_the_first_arrivals_of_each_expert():
    from mmtrain.model.moe import _capacity_mask

    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 gets 4 assignments, capacity 2
    keep = _capacity_mask(ids, 4, 1.0)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_capacity_drops_assignments_and_zeroes_them():
    cfg = _cfg(16, 8, moe_capacity_factor=0.5)
    layer = _layer(cfg)
    x = torch.randn(12, 16, requires_grad=True)
    out = layer(x[None])[0]
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.experts.w_up.grad).all()


def _ep2_vs_local(rank: int, world_size: int, shape: str, padded: bool, overlap: bool, capacity: float = 0.0):
    hidden, ffn = SHAPES[shape]
    cfg = _cfg(hidden, ffn, moe_shared_ffn_hidden_size=8, moe_capacity_factor=capacity)
    group = dist.new_group(list(range(world_size)))
    x_all = torch.randn(world_size, 3, 7, hidden, generator=torch.Generator().manual_seed(5))
    reference = _layer(cfg)
    x_ref = x_all.clone().requires_grad_()
    ref_out = torch.stack([reference(x_ref[r]) for r in range(world_size)])
    ref_out.square().sum().backward()

    layer = MoELayer(cfg, expert_dispatch(group, padded=padded, overlap_shared=overlap))
    assert layer.experts.w_up.shape[0] == cfg.num_experts // world_size  # built with this rank's experts only
    whole = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(layer.experts.own_slice(whole[name]) if name.startswith("experts.") else whole[name])
    apply_expert_parallel(layer_holder := _Holder(layer), group)
    x = x_all[rank].clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    local = cfg.num_experts // world_size
    torch.testing.assert_close(out, ref_out[rank], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad[rank], rtol=1e-5, atol=1e-5)
    # this rank's experts saw every rank's tokens: their whole gradient
    torch.testing.assert_close(layer_holder.layer.experts.w_up.grad,
                               reference.experts.w_up.grad[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)
    return True


class _Holder(torch.nn.Module):
    """A one-layer 'model' for the EP plan's check."""

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.layer = layer


@pytest.mark.parametrize("shape,padded,overlap,capacity", [
    ("grouped", False, False, 0.0), ("grouped", True, False, 0.0), ("grouped", False, True, 0.0),
    ("loop", True, True, 0.0), ("grouped", False, False, 0.75), ("grouped", True, True, 0.75),
    ("loop", False, False, 0.75)])
def test_ep2_dispatch_equals_one_process(shape, padded, overlap, capacity):
    assert run_distributed(_ep2_vs_local, 2, shape, padded, overlap, capacity) == [True, True]


def _wrong_dispatch(rank: int, world_size: int):
    group = dist.new_group(list(range(world_size)))
    holder = _Holder(_layer(_cfg(16, 8), LocalDispatch()))
    with pytest.raises(ValueError, match="expert_dispatch"):
        apply_expert_parallel(holder, group)
    return True


def test_ep_plan_refuses_a_layer_built_with_another_dispatch():
    assert run_distributed(_wrong_dispatch, 2) == [True, True]


def _overlap_is_bit_equal(rank: int, world_size: int, shape: str, padded: bool):
    """Overlap on and off: the same output and the same gradients, bit for bit; every non-expert gradient summed
    over the ranks equals the one-process one."""
    hidden, ffn = SHAPES[shape]
    cfg = _cfg(hidden, ffn, moe_shared_ffn_hidden_size=8, moe_capacity_factor=0.75 if padded else 0.0)
    group = dist.new_group(list(range(world_size)))
    x_all = torch.randn(world_size, 3, 7, hidden, generator=torch.Generator().manual_seed(7))
    reference = _layer(cfg)
    for r in range(world_size):  # one micro-batch per rank, as in the EP run (the balance loss is per micro-batch)
        reference(x_all[r]).square().sum().backward()
    whole = dict(reference.named_parameters())
    runs = []
    for overlap in (False, True):
        layer = MoELayer(cfg, expert_dispatch(group, padded=padded, overlap_shared=overlap))
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(layer.experts.own_slice(whole[name]) if name.startswith("experts.") else whole[name])
        x = x_all[rank].clone().requires_grad_()
        out = layer(x)
        out.square().sum().backward()
        runs.append((out, x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out0, gx0, g0), (out1, gx1, g1) = runs
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    for name, grad in g1.items():
        if name.startswith("experts."):
            want = layer.experts.own_slice(whole[name].grad)
        else:  # router and shared experts saw this rank's tokens: sum over ranks
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            want = whole[name].grad
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5, msg=name)
    return True


@pytest.mark.parametrize("shape,padded", [("grouped", False), ("loop", True)])
def test_ep2_overlapped_backward_is_bit_equal_and_matches_one_process(shape, padded):
    assert run_distributed(_overlap_is_bit_equal, 2, shape, padded) == [True, True]


class _RecordedWork:
    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self):
        self.log.append("wait")
        return self.work.wait()


def _backward_event_order(rank: int, world_size: int, overlap: bool):
    """The events of one MoE layer's backward: all-to-alls (sync or async), waits, shared-expert gradients."""
    group = dist.new_group(list(range(world_size)))
    log: list[str] = []
    real = dist.all_to_all_single

    def recording(*args, async_op=False, **kw):  # the one process of this worker: restored below
        work = real(*args, async_op=async_op, **kw)
        log.append("a2a-async" if async_op else "a2a")
        return _RecordedWork(work, log) if async_op else work

    layer = _layer(_cfg(16, 8, moe_shared_ffn_hidden_size=8), expert_dispatch(group, overlap_shared=overlap))
    for p in layer.shared.parameters():
        p.register_hook(lambda g: log.append("shared-grad"))
    x = torch.randn(2, 5, 16, requires_grad=True, generator=torch.Generator().manual_seed(rank))
    dist.all_to_all_single = recording
    try:
        out = layer(x)
        log.append("backward")
        out.square().sum().backward()
    finally:
        dist.all_to_all_single = real
    backward = log[log.index("backward") + 1:]
    grads = backward.count("shared-grad")
    assert grads == len(list(layer.shared.parameters()))
    if overlap:  # the combine's reverse exchange started, the shared experts' backward, then the wait
        assert backward == ["a2a-async", *["shared-grad"] * grads, "wait", "a2a"], backward
    else:
        assert backward == [*["shared-grad"] * grads, "a2a", "a2a"], backward
    return True


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_backward_issues_the_exchange_before_the_shared_expert_backward(overlap):
    assert run_distributed(_backward_event_order, 2, overlap) == [True, True]


def _recompute_changes_nothing(rank: int, world_size: int, padded: bool):
    """Full recompute (non-reentrant checkpoint, as the trainer's) around an overlapped EP2 layer: the same
    output and gradients, bit for bit (the side graph is rebuilt with the recomputed forward)."""
    from torch.utils.checkpoint import checkpoint

    group = dist.new_group(list(range(world_size)))
    runs = []
    for recompute in (False, True):
        layer = _layer(_cfg(16, 8, moe_shared_ffn_hidden_size=8),
                       expert_dispatch(group, padded=padded, overlap_shared=True))
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        out.square().sum().backward()
        runs.append((out.detach(), x.grad, [p.grad for p in layer.parameters()]))
    (out0, gx0, g0), (out1, gx1, g1) = runs
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1) and all(map(torch.equal, g0, g1))
    return True


def test_recompute_around_the_overlapped_backward_changes_nothing():
    assert run_distributed(_recompute_changes_nothing, 2, False) == [True, True]


ROW_OPS = ("index_select", "index_copy", "cat", "gather", "scatter", "index_add", "index_put", "take")


def _row_copies(layer: MoELayer, x: torch.Tensor) -> dict[str, int]:
    """The forward's ops that move hidden-size rows (float tensors of width D) by index, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    D, seen = x.shape[-1], {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__.rstrip("_")
            if name in ROW_OPS and out.is_floating_point() and out.dim() == 2 and out.shape[-1] == D:
                seen[name] = seen.get(name, 0) + 1
            return out

    with Record():
        layer(x)
    return seen


def test_local_permute_and_unpermute_move_the_rows_once_each_way():
    assert _row_copies(_layer(_cfg(16, 8)), torch.randn(2, 5, 16)) == {"index_select": 1, "index_copy": 1}


def _ep2_row_copies(rank: int, world_size: int, padded: bool):
    group = dist.new_group(list(range(world_size)))
    layer = _layer(_cfg(16, 8), expert_dispatch(group, padded=padded))
    # permute + the regroup by local expert in; the regroup's inverse + unpermute out (padded: its zero row)
    want = {"index_select": 3, "index_copy": 1, "cat": 1} if padded else {"index_select": 2, "index_copy": 2}
    assert _row_copies(layer, torch.randn(2, 5, 16)) == want
    return True


@pytest.mark.parametrize("padded", [False, True])
def test_ep2_permute_and_unpermute_move_the_rows_once_each_way(padded):
    assert run_distributed(_ep2_row_copies, 2, padded) == [True, True]
