"""``FusedAdamW`` (our caller of torch's fused AdamW kernel) updates bit for bit as ``torch.optim.AdamW(fused=True)``
does, through skipped steps (``found_inf``), gradient division (``grad_scale``), per-group weight decay and
learning-rate changes; and building and stepping ``MixedPrecisionAdamW`` does not import ``torch._dynamo``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmtrain.train.fused_adamw import FusedAdamW

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(6, 5), (7,), (3, 4, 2), (5,)]
# (lr of group 0, grad_scale, found_inf) per step; a parameter without a gradient at step 0 starts later
STEPS = [(1e-2, None, None), (3e-2, None, 0.0), (3e-2, None, 1.0), (5e-3, 4.0, None), (5e-3, 0.5, 0.0)]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0, "lr_scale": 2.0}]


def test_updates_bit_identical_to_torch_fused_adamw():
    compare_with_torch_fused_adamw(torch.device("cpu"))


def compare_with_torch_fused_adamw(device: torch.device) -> None:
    """The side-by-side run of both optimizers on ``device`` (tests/gpu runs it on CUDA)."""
    torch.manual_seed(0)
    start = [torch.randn(s, device=device) for s in SHAPES]
    ours_p = [t.clone() for t in start]
    theirs_p = [torch.nn.Parameter(t.clone()) for t in start]
    ours = FusedAdamW(_groups(ours_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    theirs = torch.optim.AdamW(_groups(theirs_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for i, (lr, grad_scale, found_inf) in enumerate(STEPS):
        for opt in (ours, theirs):
            opt.param_groups[0]["lr"] = lr
            opt.param_groups[1]["lr"] = lr * opt.param_groups[1]["lr_scale"]
        for k, (a, b) in enumerate(zip(ours_p, theirs_p)):
            g = torch.randn(a.shape, device=device) if (i, k) != (0, 3) else None
            a.grad, b.grad = (g.clone(), g.clone()) if g is not None else (None, None)
        scale = torch.tensor(grad_scale, device=device) if grad_scale is not None else None
        inf = torch.tensor(found_inf, device=device) if found_inf is not None else None
        ours.step(grad_scale=scale, found_inf=inf)
        if scale is not None:
            theirs.grad_scale = scale
        if inf is not None:
            theirs.found_inf = inf
        theirs.step()
        theirs.__dict__.pop("grad_scale", None), theirs.__dict__.pop("found_inf", None)
        for k, (a, b) in enumerate(zip(ours_p, theirs_p)):
            assert torch.equal(a, b.detach()), (i, k)
            assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), (i, k)
            assert (a in ours.state) == (b in theirs.state), (i, k)
            if a in ours.state:
                mine, ref = ours.state[a], theirs.state[b]
                assert mine.keys() == ref.keys()
                for key in mine:
                    assert mine[key].dtype == ref[key].dtype and torch.equal(mine[key], ref[key]), (i, k, key)
    # the skipped step (found_inf=1) counts nothing: 4 counted steps, 3 for the parameter that started late
    assert [float(ours.state[p]["step"]) for p in ours_p] == [4.0, 4.0, 4.0, 3.0]


def test_skipped_step_leaves_weights_and_moments():
    p = torch.randn(5)
    opt = FusedAdamW([{"params": [p]}], lr=0.1)
    p.grad = torch.randn(5)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}, p.clone()
    p.grad = torch.randn(5)
    opt.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(v, before[0][k]) for k, v in opt.state[p].items()) and torch.equal(p, before[1])


def test_rejects_what_it_does_not_support():
    with pytest.raises(TypeError, match="floating point"):
        FusedAdamW([{"params": [torch.zeros(3, dtype=torch.int64)]}])
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="more than one group"):
        FusedAdamW([{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError, match="invalid"):
        FusedAdamW([{"params": [torch.zeros(3)]}], betas=(0.9, 1.0))


_NO_DYNAMO = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.train.optimizer import MixedPrecisionAdamW
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))]
opt = MixedPrecisionAdamW([GradBuckets(params, None, False, torch.float32)], 1e-3, (0.9, 0.95), 1e-8, 0.1)
before = params[0].detach().clone()
for p in params:
    p.main_grad.normal_()
opt.divide_grads_at_step(torch.tensor(2.0))
opt.step(skip=torch.tensor(0.0))
opt.step()
assert not torch.equal(before, params[0]), "no update"
assert float(opt.optimizer.state[opt.pieces[0].master]["step"]) == 2.0
print("torch._dynamo" in sys.modules)
"""


def test_mixed_precision_adamw_does_not_import_dynamo():
    # a fresh process: this one may have imported torch._dynamo already (torch.optim above does)
    out = subprocess.run([sys.executable, "-c", _NO_DYNAMO], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
