"""What the step's passes over the gradients cost, old way and new (issue #17's before/after), one table.

    python bench/grad_scale_paths.py [--params 1.236e9] [--tensors 146] [--dtype bf16] [--reps 10]

On a gradient buffer of ``--params`` elements cut into ``--tensors`` views (the 1B bench row: 1.236e9 bf16
elements, 146 parameters, ``optim.master_weights=false``), the median time of:

- the 1/tokens scale: ``mul_`` by a Python float (the old loop, after a host sync), ``mul_`` by a 0-dim float64
  device tensor (the loop before this fix: no sync), ``_foreach_mul_`` by a 0-dim tensor of the buffer's dtype
  (now);
- the clip: ``_foreach_mul_`` over the views by a 0-dim float64 device tensor (the loop before this fix, every
  step), by a Python float (the old loop, only when the norm was over the limit), nothing (now: the divisor is
  the fused AdamW's ``grad_scale``);
- fused AdamW over the same views without and with ``grad_scale`` (what the clip costs now: the kernel writes the
  divided gradients back).

On the CPU (tiny ``--params``) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.236e9)
    ap.add_argument("--tensors", type=int, default=146)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    n = int(a.params) // a.tensors * a.tensors
    buf = torch.full((n,), 1.0, dtype=dtype, device=device)
    views = list(buf.view(a.tensors, -1).unbind(0))
    tokens = torch.tensor(16384.0, dtype=torch.float64, device=device)
    coef64 = torch.tensor(0.999, dtype=torch.float64, device=device)
    params = [torch.zeros_like(v) for v in views]
    m, v2 = [torch.zeros_like(v) for v in views], [torch.zeros_like(v) for v in views]
    steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in views]
    divisor = torch.tensor(1.001, dtype=torch.float32, device=device)

    def adamw(grad_scale=None):
        torch._fused_adamw_(params, views, m, v2, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)

    rows = [
        ("1/tokens: mul_(python float)  [old loop]", lambda: buf.mul_(1.0 / 16384.0)),
        ("1/tokens: mul_(0-dim float64 device)  [before this fix]", lambda: buf.mul_(1.0 / tokens)),
        ("1/tokens: _foreach_mul_(0-dim, grads' dtype)  [now]",
         lambda: torch._foreach_mul_([buf], (1.0 / tokens).to(dtype))),
        ("clip: _foreach_mul_(views, python float)  [old loop, clipped steps only]",
         lambda: torch._foreach_mul_(views, 0.999)),
        ("clip: _foreach_mul_(views, 0-dim float64)  [before this fix, every step]",
         lambda: torch._foreach_mul_(views, coef64)),
        ("fused AdamW", adamw),
        ("fused AdamW + grad_scale  [now: the clip]", lambda: adamw(divisor)),
    ]
    print(f"{device}: {n:,} {a.dtype} gradient elements in {a.tensors} tensors ({n * buf.element_size() / 2**30:.2f} "
          f"GiB), median of {a.reps}")
    print("| pass | ms |")
    print("|---|---|")
    for name, fn in rows:
        print(f"| {name} | {timed(fn, a.reps, device):.3f} |", flush=True)


if __name__ == "__main__":
    main()
