"""What a training step does outside the model, op by op, on the CPU: for comparing two trees' step loops.

    python bench/step_ops.py [--tree DIR] [--steps 4] [--log-every N] [key=value ...]

Runs the real loop (``mmtrain.train.loop.train_gpt`` of the tree ``--tree``, default this one) on a tiny Llama
on the CPU, and records in order every aten op (through a ``TorchDispatchMode``), every call that reads a value
back (``item``, ``tolist``, ``cpu``, ... -- a host sync on a GPU) and the loop's ``time.perf_counter`` calls
(the step timer). It prints, per loop phase (the loop's own ``_Run.phase`` labels; the model's forward and
backward are counted, not listed), the ops outside the model with their count and the bytes they read and write
per trainable parameter (what sets their GPU time: x 1.24e9 parameters / ~4 TB/s for the 1B bench row), and
flags the ops that leave CUDA's fast paths:

- ``0-dim device scalar``: an elementwise op whose 0-dim tensor operand has another dtype than the big tensor
  (on CUDA a non-vectorised, dynamically casting kernel instead of a vectorised one with a host scalar);
- ``foreach slow path``: a ``_foreach_*`` op with a tensor scalar of another dtype than the list (on CUDA one
  kernel per tensor instead of one multi-tensor kernel).

Then, per step: the reads inside the timer and the bytes of the ops launched after the last of them but before
the timer stops (on a GPU that work runs after the timer's reading: a step time that leaves it out) and the
reads after the timer stops (outside the step time). ``--json FILE`` writes everything for a diff.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=256"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the mmtrain tree to run")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=1000000, help="logging.log_every (the last step logs anyway)")
    ap.add_argument("--eager-adamw", action="store_true",
                    help="keep a tree's CPU choice of AdamW (default: fused, as both trees use on CUDA)")
    ap.add_argument("--compile", action="store_true",
                    help="train.compile=true (inductor on the CPU, slow); also prints dynamo's graph counts")
    ap.add_argument("--model-ops", action="store_true", help="list the model's forward/backward ops one by one too")
    ap.add_argument("--json", help="write the per-phase table and the step events to this file")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    tree = Path(a.tree).resolve()
    sys.path.insert(0, str(tree))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from mmtrain.config import GPTRunConfig, load_config
    from mmtrain.parallel import ParallelDims, init_distributed
    from mmtrain.train import loop

    assert Path(loop.__file__).resolve().is_relative_to(tree), f"imported {loop.__file__}, not from {tree}"
    events: list[tuple] = []  # (step, phase, kind, name, bytes, flag)
    state = {"run": None, "step": 0, "in_model": False}

    def phase() -> str:
        if state["in_model"]:
            return "model forward/backward"
        run = state["run"]
        return run.phase if run is not None else "start-up"

    def nbytes(t) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    def traffic(func, args, kwargs, out) -> int:
        """Bytes read and written: every tensor argument once, twice when the op writes it, new outputs once."""
        total = 0
        values = dict(zip([x.name for x in func._schema.arguments], args)) | (kwargs or {})
        for arg in func._schema.arguments:
            written = arg.alias_info is not None and arg.alias_info.is_write
            total += (2 if written else 1) * sum(nbytes(x) for x in tree_flatten(values.get(arg.name))[0])
        if not any(r.alias_info is not None for r in func._schema.returns):
            total += sum(nbytes(x) for x in tree_flatten(out)[0])
        return total

    def fast_path_flag(func, args) -> str:
        name = func.__name__
        flat = [x for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]
        if name.startswith("_foreach_") and len(args) > 1 and isinstance(args[0], (list, tuple)) and args[0] \
                and isinstance(args[1], torch.Tensor) and args[1].dim() == 0 and args[1].dtype != args[0][0].dtype:
            return f"foreach slow path ({args[1].dtype} scalar, {args[0][0].dtype} list)"
        big = [x for x in flat if x.dim() > 0]
        small = [x for x in flat if x.dim() == 0]
        if big and small and not name.startswith(("_foreach_", "_fused_")) and any(s.dtype != big[0].dtype for s in small):
            return f"0-dim device scalar ({small[0].dtype} with {big[0].dtype})"
        return ""

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if state["step"]:
                moved = 0 if func.is_view else traffic(func, args, kwargs, out)
                events.append((state["step"], phase(), "op", str(func.overloadpacket.__name__), moved,
                               fast_path_flag(func, args)))
            return out

    def wrap_read(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if state["step"]:
                events.append((state["step"], phase(), "read", name, 0, ""))
            return original(self, *args, **kwargs)
        return read

    class Clock:  # the loop module's ``time``: its perf_counter calls are the step timer's start and stop
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def perf_counter():
            if state["step"]:
                events.append((state["step"], phase(), "timer", "perf_counter", 0, ""))
            return time.perf_counter()

    step_fn = loop._Run.step

    def recorded_step(self, n):
        if state["run"] is None:
            fb = self.task.forward_backward

            def model_part(*args):
                state["in_model"] = True
                try:
                    return fb(*args)
                finally:
                    state["in_model"] = False
            self.task.forward_backward = model_part
        state["run"], state["step"] = self, n
        self.phase = "step start (lr, data, bucket reset)"
        try:
            return step_fn(self, n)
        finally:
            state["step"] = 0

    if not a.eager_adamw:  # the before tree picks fused AdamW on CUDA only; on the CPU its eager one reads steps back
        adamw_init = torch.optim.AdamW.__init__

        def fused_adamw(self, *args, fused=None, **kwargs):
            adamw_init(self, *args, fused=True if fused is None else fused, **kwargs)
        torch.optim.AdamW.__init__ = fused_adamw
    loop._Run.step = recorded_step
    loop.time = Clock()
    for name in READS:
        setattr(torch.Tensor, name, wrap_read(name))
    cfg = load_config(GPTRunConfig, str(tree / "configs/models/llama3.2-1b.yaml"), [
        "data.mock=true", "data.seq_length=32", "train.micro_batch_size=2", f"train.steps={a.steps}",
        "train.device=cpu", "train.precision=bf16", "optim.master_weights=false", "optim.warmup_steps=1", "optim.lr=1e-4",
        "logging.run_dir=/tmp/mmtrain-step-ops", f"logging.log_every={a.log_every}", "checkpoint.save_final=false",
        *TINY, *(["train.compile=true"] if a.compile else []), *a.overrides])
    device = torch.device("cpu")
    init_distributed("gloo", device)
    mesh = ParallelDims.from_config(cfg.parallel, 1).build()
    with Record():
        result = loop.train_gpt(cfg, mesh, device)
    n_params = sum(p.numel() for p in result.model.parameters() if p.requires_grad)
    if a.compile:
        from torch._dynamo.utils import counters
        from torch._inductor import metrics

        print("compiled:", {k: dict(counters.get(k, {})) for k in ("stats", "graph_break", "recompiles")},
              f"inductor kernels: {metrics.generated_kernel_count}")

    steady = [e for e in events if e[0] > 1]  # step 1 sets up optimizer state
    steps = max(a.steps - 1, 1)
    table = defaultdict(lambda: [0, 0, set()])
    for _, ph, kind, name, moved, flag in steady:
        key = (ph, kind, name if ph != "model forward/backward" or a.model_ops else "(model ops)")
        table[key][0] += 1
        table[key][1] += moved
        if flag:
            table[key][2].add(flag)
    print(f"tree {tree}: {n_params:,} trainable parameters, steps 2..{a.steps} averaged; bytes per parameter "
          "(x 1.24e9 / 4e12 B/s = ms on an H200 for the 1B row)")
    print("| phase | kind | op | per step | bytes / param / step | CUDA fast path? |")
    print("|---|---|---|---|---|---|")
    rows = []
    for (ph, kind, name), (count, moved, flags) in table.items():
        row = {"phase": ph, "kind": kind, "op": name, "per_step": count / steps,
               "bytes_per_param": moved / steps / n_params, "flag": "; ".join(sorted(flags))}
        rows.append(row)
        print(f"| {ph} | {kind} | {name} | {row['per_step']:g} | {row['bytes_per_param']:.2f} | "
              f"{row['flag'] or 'yes'} |")
    print()
    print("| step | reads inside the timer | bytes/param launched after the last of them, before the timer stops "
          "| reads after the timer stops |")
    print("|---|---|---|---|")
    per_step = []
    for s in range(1, a.steps + 1):
        ev = [e for e in events if e[0] == s]
        timers = [i for i, e in enumerate(ev) if e[2] == "timer"]
        stop = timers[1] if len(timers) > 1 else len(ev)
        reads_in = [i for i, e in enumerate(ev[:stop]) if e[2] == "read"]
        last = reads_in[-1] if reads_in else timers[0] if timers else 0
        unwaited = sum(e[4] for e in ev[last:stop] if e[2] == "op") / n_params
        after = [e[3] for e in ev[stop:] if e[2] == "read"]
        per_step.append({"step": s, "reads_in_timer": len(reads_in), "unwaited_bytes_per_param": unwaited,
                         "reads_after_timer": after})
        print(f"| {s} | {len(reads_in)} | {unwaited:.2f} | {', '.join(after) or '-'} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"tree": str(tree), "params": n_params, "phases": rows,
                                            "steps": per_step, "losses": result.losses}, indent=1))


if __name__ == "__main__":
    main()
