"""Token dispatch strategies (mmtrain.parallel.moe_dispatch): the local dispatch equals a per-token reference;
the EP2 all-to-all dispatch — exact and padded splits, with and without the shared expert overlapped — gives
the one-process outputs and gradients, each rank building only its experts; a layer built with the wrong
dispatch is refused by the EP plan."""

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
