"""The work a training step does on the gradients outside the model stays on CUDA's fast paths and makes no pass
more than it needs (issue #17's H200 before/after: ~10 ms per 1B step). Counted on the CPU from the ops the loop
dispatches (``bench/step_ops.py`` prints the whole table):

- neither the 1 / tokens scale nor the clip makes a pass of its own: the fused AdamW kernel divides by
  ``tokens * max(1, norm / max_norm)`` (the scale was one multi-tensor multiply over the whole gradient buffer, 8
  bytes a parameter; an always-on ``_foreach_mul_`` with a float64 scalar fell back to one kernel per tensor);
- and the result equals the gradients divided by the token count, then torch's ``clip_grad_norm_`` and the same
  AdamW.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train import loop

BASE = ["data.mock=true", "data.seq_length=16", "train.device=cpu", "train.steps=3", "train.micro_batch_size=2",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.vocab_size=64", "checkpoint.save_final=false", "logging.log_every=3"]
GRAD_PHASES = ("gradient reduction", "gradient clipping and optimizer step")


def _grad_ops(rank: int, world_size: int, run_dir: str, extra: list[str]):
    """(phase, op, tensor-scalar dtype, list/tensor dtype, elements) of every multiply-like op of steps 2-3 in the
    loop's gradient phases."""
    seen = []
    current = {"run": None, "step": 0}
    step = loop._Run.step

    def tracked_step(self, n):
        current["run"], current["step"] = self, n
        return step(self, n)
    loop._Run.step = tracked_step

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            run = current["run"]
            name = func.overloadpacket.__name__
            if current["step"] > 1 and run is not None and run.phase in GRAD_PHASES and name in (
                    "mul", "mul_", "div", "div_", "_foreach_mul_", "_foreach_div_", "_foreach_mul", "_foreach_div"):
                flat = [x for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]
                scalars = [x for x in flat if x.dim() == 0]
                big = [x for x in flat if x.dim() > 0]
                if big:
                    seen.append((run.phase, name, scalars[0].dtype if scalars else None, big[0].dtype,
                                 sum(x.numel() for x in big)))
            return func(*args, **(kwargs or {}))

    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    with Record():
        result = loop.train_gpt(cfg, mesh, torch.device("cpu"))
    n_params = sum(p.numel() for p in result.model.parameters())
    return seen, n_params


@pytest.mark.parametrize("extra", [["train.precision=fp32"],
                                   ["train.precision=bf16", "optim.master_weights=false", "optim.grad_clip=1e-3"]])
def test_no_scale_pass_and_no_clip_pass(tmp_path, extra):
    seen, n_params = run_distributed(_grad_ops, 1, str(tmp_path), extra)[0]
    big = [s for s in seen if s[4] >= n_params]  # ops over (at least) every gradient element
    assert big == [], big


def _clip_then_adamw(rank: int, world_size: int, max_norm: float):
    """The loop's token division and clip (one divisor in the fused kernel) against the summed gradients divided
    by the token count, torch's clip_grad_norm_ and AdamW."""
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.parallel.grad_buckets import GradBuckets
    from mmtrain.train.grads import clip_grad_norm, finalize_grads
    from mmtrain.train.optimizer import MixedPrecisionAdamW

    cfg = load_config(GPTRunConfig, None, BASE).model
    torch.manual_seed(0)
    model = GPTModel(cfg)
    model.init_weights(1)
    reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    mesh = ParallelDims.from_config(load_config(GPTRunConfig, None, BASE).parallel, 1).build()
    buckets = [GradBuckets(list(model.parameters()), mesh.dp_cp_group, False, torch.float32)]
    opt = MixedPrecisionAdamW(buckets, 1e-2, (0.9, 0.95), 1e-8, 0.0, master_weights=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).sum().backward()  # a sum over the 32 loss tokens
    num_tokens = torch.tensor(32.0, dtype=torch.float64)
    finalize_grads(model, mesh, buckets, opt, num_tokens)
    grads = [p.main_grad / 32.0 for p in model.parameters()]
    norm = clip_grad_norm(model, mesh, opt, max_norm)
    opt.step()
    for r, g in zip(reference, grads):
        r.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True).step()
    return (float(norm), float(ref_norm),
            max(float((p - r).detach().abs().max()) for p, r in zip(model.parameters(), reference)),
            max(float((p.main_grad - r.grad).abs().max()) for p, r in zip(model.parameters(), reference)))


@pytest.mark.parametrize("max_norm", [1e-3, 1e6])  # clipped, and not
def test_clip_in_the_optimizer_equals_torch_clip_grad_norm(max_norm):
    norm, ref_norm, param_diff, grad_diff = run_distributed(_clip_then_adamw, 1, max_norm)[0]
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    assert param_diff < 1e-6 and grad_diff < 1e-6 * max(1.0, ref_norm)  # the gradients end up clipped too
