"""Where a step's time goes, from a torch.profiler run: GPU kernel time per category and the host gap.

Used by bench/train_gpt.py ``--profile FILE`` (and bench/vlm_h200.py): the profiler records CUDA kernels over a
few timed steps of the product's own loop; each kernel falls into the first category whose name pattern it
matches (lower-cased kernel name):

- matmul: cuBLAS / CUTLASS / nvjet GEMMs (bf16 and FP8 ``_scaled_mm``), grouped GEMMs of the MoE experts;
- attention: flash / cuDNN / efficient SDPA, FlexAttention's Triton template (``triton_tem``: the loop compiles
  no matmul templates, so a template kernel is FlexAttention's forward or backward);
- optimizer: the multi-tensor AdamW kernels and the foreach ops of clipping / casts;
- communication: NCCL;
- norms / elementwise / loss: Inductor's fused pointwise and reduction kernels (RMSNorm, RoPE, SwiGLU, the
  cross-entropy, FP8's casts and amaxes), the gradient-accumulation kernel and eager elementwise kernels;
- memcpy / memset; other: the rest.

The host gap is the step's wall time minus its GPU busy time (kernels run one stream at a time in this loop, so
their sum is the busy time): time the GPU waited for the host (launches, Python, syncs).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "triton_tem", "cudnn")),
    # Inductor's fused pointwise / reduction kernels before the GEMM patterns: their names list the ops they fuse,
    # e.g. FP8's casts and amaxes around ``_scaled_mm`` (``triton_red_fused_..._scaled_mm_...``), no GEMM
    ("norms / elementwise / loss", ("triton_poi", "triton_red", "triton_per", "accumulate_kernel")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm100_", "cublas", "_mm_", "grouped")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("memcpy / memset", ("memcpy", "memset")),
    ("norms / elementwise / loss", ("triton_", "elementwise", "reduce", "vectorized", "unrolled", "softmax",
                                    "cross_entropy", "nll", "index", "scatter", "gather", "copy", "fill", "cat")),
)


def category_of(kernel_name: str) -> str:
    """The first category whose patterns occur in ``kernel_name`` (lower-cased), else ``other``."""
    name = kernel_name.lower()
    for category, patterns in CATEGORIES:
        if any(p in name for p in patterns):
            return category
    return "other"


def kernel_times(prof) -> list[tuple[str, float]]:
    """(kernel name, total self GPU µs) of every device-side event of a finished ``torch.profiler`` run."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if t > 0 and str(getattr(e, "device_type", "")).endswith("CUDA"):
            rows.append((e.key, float(t)))
    return rows


def summarize(prof, steps: int, wall_ms_per_step: float, top: int = 25) -> str:
    """A markdown summary: ms per step per category (and % of the wall step), the host gap, the top kernels."""
    rows = kernel_times(prof)
    per_cat: dict[str, float] = {}
    for name, us in rows:
        per_cat[category_of(name)] = per_cat.get(category_of(name), 0.0) + us
    busy_ms = sum(per_cat.values()) / 1e3 / steps
    lines = [f"step wall {wall_ms_per_step:.1f} ms, GPU busy {busy_ms:.1f} ms ({steps} profiled steps)", "",
             "| where | ms / step | % of step |", "|---|---|---|"]
    for category, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        ms = us / 1e3 / steps
        lines.append(f"| {category} | {ms:.1f} | {100 * ms / wall_ms_per_step:.1f}% |")
    gap = max(wall_ms_per_step - busy_ms, 0.0)
    if busy_ms > 1.02 * wall_ms_per_step:  # kernels overlapped (several streams) or the window was not one step
        lines.insert(1, f"(GPU busy exceeds the wall step by {busy_ms / wall_ms_per_step - 1:.0%}: read the "
                        "categories as shares of GPU time)")
    lines.append(f"| host gap (wall - GPU busy) | {gap:.1f} | {100 * gap / wall_ms_per_step:.1f}% |")
    lines += ["", "| top kernels | category | ms / step |", "|---|---|---|"]
    for name, us in sorted(rows, key=lambda r: -r[1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {category_of(name)} | {us / 1e3 / steps:.2f} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def profiling(skip: int, active: int):
    """torch.profiler (CUDA kernels) over optimizer steps ``skip + 1 .. skip + active`` of the loop, or nothing
    when ``active`` is 0. Advances the profiler once per step by wrapping the loop's step (this process only)."""
    if not active:
        yield None
        return
    from mmtrain.train import loop

    sched = torch.profiler.schedule(wait=max(skip - 1, 0), warmup=1 if skip else 0, active=active)
    original = loop._Run.step
    cuda = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    done = [0]
    with torch.profiler.profile(activities=[activity], schedule=sched) as prof:
        def stepping(self, step):
            out = original(self, step)
            done[0] += 1
            # The loop runs ahead of the GPU (no per-step sync), so without a sync at the window's two edges the
            # window would record kernels of the step before it and miss the tail of its last step.
            if cuda and done[0] in (skip, skip + active):
                torch.cuda.synchronize()
            prof.step()
            return out
        loop._Run.step = stepping
        try:
            yield prof
        finally:
            loop._Run.step = original


@contextlib.contextmanager
def host_profiling(skip: int, steps: int, path: str | None, top: int = 30):
    """cProfile of the host from the end of loop step ``skip`` to the end of step ``skip + steps`` (data, launches,
    Python, and any wait on the GPU: a synchronizing call shows as a long call), written to ``path`` as a markdown
    table of the functions with the most own time. Nothing when ``path`` is None. cProfile slows the Python it
    watches, so the caller leaves these steps out of its timing."""
    if not path or not steps:
        yield
        return
    import cProfile
    import pstats

    from mmtrain.train import loop

    original, profiler, done = loop._Run.step, cProfile.Profile(), [0]

    def stepping(self, step):
        out = original(self, step)
        done[0] += 1
        if done[0] == skip:
            profiler.enable()
        elif done[0] == skip + steps:
            profiler.disable()
        return out

    loop._Run.step = stepping
    try:
        yield
    finally:
        loop._Run.step = original
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, prim, tottime, cumtime, callers)}
        total = sum(v[2] for v in stats.values()) or 1e-9
        lines = [f"host profile (cProfile), steps {skip + 1}-{skip + steps}: {1e3 * total / steps:.1f} ms of "
                 "Python-visible host time a step", "", "| function | calls / step | own ms / step | % | "
                 "cumulative ms / step |", "|---|---|---|---|---|"]
        for (file, line, name), (calls, _, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
            where = f"{'/'.join(file.split('/')[-2:])}:{line} {name}" if file != "~" else name
            lines.append(f"| `{where[-100:]}` | {calls / steps:.0f} | {1e3 * own / steps:.2f} | "
                         f"{100 * own / total:.1f}% | {1e3 * cum / steps:.2f} |")
        from mmtrain.utils.atomic import atomic_write_text

        atomic_write_text(Path(path), "\n".join(lines) + "\n")
