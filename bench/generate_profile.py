"""Where a decode step's time goes: the compiled KV-cache decode step (CUDA graphs) of bench/generate.py's model,
profiled over a few steps of a batch-1 (or --batch) generation with torch.profiler. Prints the GPU time per
step against the wall time per step (the difference is time the GPU waited: launch gaps or host work), the
kernels per step, and the kernels that take the most time, with the bytes they would read at HBM speed.

    python bench/generate_profile.py [--batch 1] [--steps 32] [--tiny] [--device cpu] [--ckpt CKPT_OR_FOLDER]
                                     [--temperature T]

``--ckpt``: the model ``mmtrain.generate`` loads from a checkpoint or a quantized folder (``mmtrain.quantize``'s
FP8 or int4 kernels) instead of bench/generate.py's random model.

For issue #19's batch-1 goal (>= 845 new tokens/s, 1.18 ms a step at Llama-3.2-1B shapes; the step reads 2.47 GB
of weights, 0.59 ms at 4.2 TB/s). ``--tiny --device cpu`` checks that the script runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.generate import build_model  # noqa: E402
from mmtrain.inference.engine import DecodeEngine, generate  # noqa: E402
from mmtrain.inference.sampling import SamplingParams  # noqa: E402


def loaded_model(ckpt: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The one-process model ``mmtrain.generate`` decodes from ``ckpt``."""
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    init_distributed(device=device)
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1, tp=1).build(), device, dtype)
    finally:
        shutdown_distributed()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ckpt", default=None, help="a checkpoint or quantized folder to profile")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: every row sampled (seeded), as GRPO draws")
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(a.tiny, device, dtype) if a.ckpt is None else loaded_model(a.ckpt, device, dtype)
    engine = DecodeEngine(model, a.batch, a.prompt + a.steps + 8, compile=True)
    prompts = [[1 + i] * a.prompt for i in range(a.batch)]
    params = [SamplingParams(max_new_tokens=a.steps, temperature=a.temperature,
                             seed=i if a.temperature > 0 else None) for i in range(a.batch)]
    for _ in range(2):  # compile and capture at the profiled shapes
        generate(engine, prompts, params)
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        generate(engine, prompts, params)
        if cuda:
            torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t0) / a.steps
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.time_range.elapsed_us() / 1000)  # ms: a device event spans its kernel
    gpu_ms = sum(sum(v) for v in kernels.values()) / a.steps
    count = sum(len(v) for v in kernels.values()) / a.steps
    print(f"batch {a.batch}, {a.steps} steps (prefill included): wall {wall_ms:.3f} ms/step, GPU busy "
          f"{gpu_ms:.3f} ms/step ({gpu_ms / wall_ms:.0%}), {count:.0f} kernels/step")
    print("\n| kernel | calls/step | ms/step | share of GPU time |\n|---|---|---|---|")
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:a.top]:
        ms = sum(times) / a.steps
        print(f"| {name[:90]} | {len(times) / a.steps:.1f} | {ms:.4f} | {ms / gpu_ms:.1%} |")
    if not cuda:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
