"""Where an FP8 block's time goes, on one GPU: one compiled Llama-3.2-1B transformer block (batch 4 x 4096 by
default), forward + backward, BF16 vs each native FP8 variant: ms per block (CUDA events) and the kernels by
GPU time, grouped into GEMMs (_scaled_mm / cuBLAS / CUTLASS), attention (flash) and everything else (Inductor's
Triton kernels: norms, SwiGLU, RoPE, FP8 casts, amaxes, transposes). BF16's "everything else" is the floor; the
FP8 excess over it is the quantization overhead per block (x16 layers per step).

    python3 bench/fp8_block_profile.py [--variants bf16 tensorwise delayed delayed-fast-bwd] [--top 15]
        [--batch 4] [--seq 4096] [--model configs/models/llama3.2-1b.yaml]

One process, a few seconds of compile per variant. On the CPU it runs too (tiny shapes: --model
configs/models/tiny.yaml --batch 2 --seq 64), timing with wall clock, which only checks the script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.model.fp8 import apply_native_fp8
from mmtrain.model.fp8_scaling import AmaxHistory, fp8_dtypes
from mmtrain.models.llama.model import GPTModel
from mmtrain.model.layers import rope_cos_sin

VARIANTS = {"bf16": [], "tensorwise": ["fp8.recipe=tensorwise"], "delayed": ["fp8.recipe=delayed"],
            "tensorwise-fast-bwd": ["fp8.recipe=tensorwise", "fp8.fast_accum_backward=true"],
            "delayed-fast-bwd": ["fp8.recipe=delayed", "fp8.fast_accum_backward=true"]}


def kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "scaled_mm", "cublas", "xmma")):
        return "gemm"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    return "other"


def build(variant: str, a, device: torch.device):
    fp8 = variant != "bf16"
    cfg = load_config(GPTRunConfig, a.model, ["data.mock=true", "model.num_layers=1", "train.device=cuda",
                                              *(["train.precision=fp8", "fp8.backend=native"] if fp8 else []),
                                              *VARIANTS[variant]])
    model = GPTModel(cfg.model).to(device=device, dtype=torch.bfloat16)
    model.init_weights(1)
    matmuls = apply_native_fp8(model, cfg) if fp8 else []
    for m in matmuls:
        m.refresh_weight(m.weight_ref)
    block = model.layers["0"]
    B, S, D = a.batch, a.seq, cfg.model.hidden_size
    cos, sin = rope_cos_sin(torch.arange(S, device=device).expand(B, S), model.inv_freq, torch.bfloat16)
    x = (torch.randn(B, S, D, device=device, dtype=torch.bfloat16) * 0.5).requires_grad_()
    g = torch.randn(B, S, D, device=device, dtype=torch.bfloat16) * 1e-3
    history = None
    if cfg.fp8.recipe == "delayed" and fp8:
        history = AmaxHistory(matmuls, cfg.fp8.amax_history_len, cfg.fp8.amax_compute_algo, cfg.fp8.margin,
                              *fp8_dtypes(cfg.fp8.format))
        block(x, cos, sin).backward(g)  # eager step with current amaxes, then known scales (the steady state)
        history.update()
    run = torch.compile(block, dynamic=False)

    def step():
        run(x, cos, sin).backward(g)
        x.grad = None
    return step, matmuls


def time_steps(step, device: torch.device, n: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return 1000 * (time.perf_counter() - t0) / n


def profile(step, device: torch.device, n: int, top: int) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                      else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) if device.type == "cuda" else e.self_cpu_time_total
        if t and (device.type != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA):
            rows.append((t / n / 1000, e.count // n, e.key))
    rows.sort(reverse=True)
    groups: dict[str, float] = {}
    for ms, _, name in rows:
        groups[kind(name)] = groups.get(kind(name), 0.0) + ms
    return {"groups": groups, "top": rows[:top], "kernels": sum(c for _, c, _ in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=["bf16", "tensorwise", "delayed", "delayed-fast-bwd"])
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    summary = []
    for variant in a.variants:
        torch._dynamo.reset()
        step, _ = build(variant, a, device)
        for _ in range(3):
            step()
        ms = time_steps(step, device, a.iters)
        p = profile(step, device, 3, a.top)
        g = p["groups"]
        summary.append((variant, ms, g))
        print(f"\n### {variant}: {ms:.2f} ms per block fwd+bwd; kernel time: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(g.items())) + f"; {p['kernels']} kernel launches",
              flush=True)
        for t, count, name in p["top"]:
            print(f"  {t:7.3f} ms  x{count:<3d} [{kind(name)}] {name[:110]}", flush=True)
    print("\n| variant | ms/block | gemm ms | attention ms | other ms | x16 layers |")
    print("|---|---|---|---|---|---|")
    for variant, ms, g in summary:
        print(f"| {variant} | {ms:.2f} | {g.get('gemm', 0):.2f} | {g.get('attention', 0):.2f} | "
              f"{g.get('other', 0):.2f} | {16 * ms:.1f} |")


if __name__ == "__main__":
    main()
