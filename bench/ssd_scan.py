"""The Mamba-2 mixer's sequence ops alone on one GPU, forward and forward+backward, one table:
- the SSD chunked scan: the PyTorch reference (``ssd.ssd_chunked_scan``, what the CPU runs) against fla-core's
  Triton kernels (``ssd_triton.ssd_chunked_scan_triton``, what ``ssd_scan`` runs on CUDA without gradients) and
  mamba-ssm's (``ssd_mamba.ssd_chunked_scan_mamba``, what it runs with gradients; a row when mamba-ssm is
  installed, imported as training imports it);
- the depthwise causal convolution over x|B|C: ``mixer.causal_conv`` eager and compiled (the model compiles its
  blocks) against fla's ``causal_conv1d`` (``conv_triton``).

    python bench/ssd_scan.py [--model configs/models/hybrid-1b.yaml] [--shapes 4x4096 1x32768] [--documents 0]
                             [--scans reference fla mamba] [--convs eager compiled fla]

Dims: the Mamba layers of ``--model``'s ``model.nemotron_h`` (default, or when the file is missing: 64 heads x
head dim 64, state 128, 8 groups, chunk 128, hidden 2048). bf16 x, B, C; fp32 dt (log-uniform in [1e-3, 1e-1])
and A (in [-16, -1]), as the mixer passes them. ``--documents N``: packed rows of documents of mean N tokens
(the state and the conv window reset at each start). Times: median of ``--iters`` calls after warm-up (fla's and
mamba-ssm's first calls autotune: mamba-ssm compiles ~120 kernel configs for its forward and backward, once per
dtype and document mode, kept in Triton's disk cache); "fwd" under no_grad, "fwd+bwd" with gradients of every
input. ``--scans`` / ``--convs``: the rows to run (default: all that this machine has); a row that fails (fla's
backward refused on Hopper) is reported and the others still run.

FLOPs: the family's ``flops.ssd_flops_per_token`` (the Mamba-2 paper's count of its chunked algorithm at the
config's chunk length: C.B^T per group, scores x, chunk states, state read-out and passing), x3 for
forward+backward; the same numerator for every row, so TFLOP/s compare speeds (fla's own work differs: 64-token
chunks, B and C expanded to every head). The conv rows have no FLOP figure (elementwise work). "error": the
output's norm-relative difference from the reference's.
On a machine without CUDA it runs the PyTorch rows only (a smoke check: ``--shapes 1x256 --heads 4 --groups 2``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.models.nemotron_h.config import NemotronHConfig  # noqa: E402
from mmtrain.models.nemotron_h.conv_triton import causal_conv_triton  # noqa: E402
from mmtrain.models.nemotron_h.flops import ssd_flops_per_token  # noqa: E402
from mmtrain.models.nemotron_h.mixer import causal_conv  # noqa: E402
from mmtrain.models.nemotron_h.ssd import ssd_chunked_scan  # noqa: E402
from mmtrain.models.nemotron_h.ssd_mamba import mamba_ssd_available, ssd_chunked_scan_mamba  # noqa: E402
from mmtrain.models.nemotron_h.ssd_triton import ssd_chunked_scan_triton  # noqa: E402


def mamba_dims(a: argparse.Namespace) -> NemotronHConfig:
    """The Mamba shape: --model's section when the file exists, else the defaults, then any explicit flag."""
    if a.model and Path(a.model).exists():
        from mmtrain.config import GPTRunConfig, load_config

        shape = load_config(GPTRunConfig, a.model, ["data.mock=true"]).model.shape()
        if not isinstance(shape, NemotronHConfig):
            raise SystemExit(f"{a.model}: model.family is not nemotron_h")
    else:
        shape = NemotronHConfig(hidden_size=2048, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
                                n_groups=8, chunk_size=128)
    for flag, field in (("heads", "mamba_num_heads"), ("head_dim", "mamba_head_dim"), ("state", "ssm_state_size"),
                        ("groups", "n_groups"), ("chunk", "chunk_size")):
        if getattr(a, flag) is not None:
            setattr(shape, field, getattr(a, flag))
    return shape


def documents(batch: int, seq: int, mean: int, device) -> torch.Tensor | None:
    """Document ids of packed rows, lengths geometric with mean ``mean`` (None: one sequence per row)."""
    if not mean:
        return None
    g = torch.Generator().manual_seed(0)
    starts = torch.rand(batch, seq, generator=g) < 1.0 / mean
    starts[:, 0] = False
    return starts.long().cumsum(1).to(device)


def timed(fn, iters: int, sync) -> float:
    """Median ms of ``iters`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(fn, inputs: dict, grad_names: list[str], iters: int, sync) -> tuple[float, float, torch.Tensor]:
    """(forward ms, forward+backward ms, the forward's first output)."""
    with torch.no_grad():
        out = fn(**inputs)
        first = out[0] if isinstance(out, tuple) else out
        forward = timed(lambda: fn(**inputs), iters, sync)
    leaves = {k: (v.detach().requires_grad_(True) if k in grad_names else v) for k, v in inputs.items()}
    cotangent = torch.randn_like(first)

    def step():
        out = fn(**leaves)
        (out[0] if isinstance(out, tuple) else out).backward(cotangent)

    return forward, timed(step, iters, sync), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "configs/models/hybrid-1b.yaml"))
    ap.add_argument("--shapes", nargs="+", default=["4x4096", "1x32768"])
    ap.add_argument("--documents", type=int, default=0, help="mean document length of packed rows (0: none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--scans", nargs="*", choices=["reference", "fla", "mamba"], default=["reference", "fla", "mamba"],
                    help="the scan rows to run (those this machine has)")
    ap.add_argument("--convs", nargs="*", choices=["eager", "compiled", "fla"], default=["eager", "compiled", "fla"],
                    help="the convolution rows to run (none: no conv rows)")
    for flag in ("heads", "head-dim", "state", "groups", "chunk"):
        ap.add_argument(f"--{flag}", type=int, help="override the model's value")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = mamba_dims(a)
    H, P, N, G, Q = (shape.mamba_num_heads, shape.mamba_head_dim, shape.ssm_state_size, shape.n_groups,
                     shape.chunk_size)
    channels = H * P + 2 * G * N
    per_token = ssd_flops_per_token(shape)
    scans = {"PyTorch reference": ("reference", ssd_chunked_scan)}
    if cuda:
        scans["fla-core Triton"] = ("fla", ssd_chunked_scan_triton)
        if mamba_ssd_available():
            scans["mamba-ssm Triton"] = ("mamba", ssd_chunked_scan_mamba)
        else:
            print("# no mamba-ssm row: mamba_ssm.ops.triton.ssd_combined does not import here")
    scans = {name: fn for name, (key, fn) in scans.items() if key in a.scans}
    convs = {"PyTorch eager": ("eager", causal_conv)}
    if cuda:
        convs.update({"PyTorch compiled": ("compiled", torch.compile(causal_conv)),
                      "fla-core Triton": ("fla", causal_conv_triton)})
    convs = {name: fn for name, (key, fn) in convs.items() if key in a.convs}
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU'}; heads {H} x head dim {P}, state {N}, groups {G}, "
          f"chunk {Q}; conv channels {channels} x {shape.conv_kernel}; documents: "
          f"{f'mean {a.documents} tokens' if a.documents else 'none'}; SSD forward {per_token / 1e6:.2f} MFLOP "
          f"per token and layer (flops.ssd_flops_per_token)")
    rows = []
    for text in a.shapes:
        B, S = (int(v) for v in text.split("x"))
        g = torch.Generator(device=device).manual_seed(0)
        on = {"device": device, "generator": g}
        scan_inputs = {
            "x_BSHP": torch.randn(B, S, H, P, **on).bfloat16(),
            "dt_BSH": torch.exp(torch.rand(B, S, H, **on) * math.log(100.0) + math.log(1e-3)),
            "A_H": -torch.exp(torch.rand(H, **on) * math.log(16.0)),
            "B_BSGN": torch.randn(B, S, G, N, **on).bfloat16(), "C_BSGN": torch.randn(B, S, G, N, **on).bfloat16(),
            "chunk_size": Q, "doc_ids_BS": documents(B, S, a.documents, device)}
        reference = None
        for name, fn in scans.items():
            try:
                fwd, both, y = measure(fn, scan_inputs, ["x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN"], a.iters,
                                       sync)
            except Exception as err:  # a row that fails is reported, the others still run
                rows.append({"op": "SSD scan", "impl": name, "shape": text, "error": f"failed: {err}"[:120]})
                continue
            reference = y if reference is None else reference
            error = float((y.double() - reference.double()).norm() / reference.double().norm())
            rows.append({"op": "SSD scan", "impl": name, "shape": text, "fwd_ms": round(fwd, 2),
                         "fwd_tflops": round(B * S * per_token / fwd / 1e9, 1), "fwd_bwd_ms": round(both, 2),
                         "fwd_bwd_tflops": round(3 * B * S * per_token / both / 1e9, 1), "error": f"{error:.1e}"})
        conv_inputs = {"x_BSC": torch.randn(B, S, channels, **on).bfloat16(),
                       "weight_C1K": (torch.randn(channels, 1, shape.conv_kernel, **on) * 0.5).bfloat16(),
                       "bias_C": torch.randn(channels, **on).bfloat16(), "doc_ids_BS": scan_inputs["doc_ids_BS"]}
        reference = None
        for name, fn in convs.items():
            fwd, both, y = measure(fn, conv_inputs, ["x_BSC", "weight_C1K", "bias_C"], a.iters, sync)
            reference = y if reference is None else reference
            error = float((y.double() - reference.double()).norm() / reference.double().norm())
            rows.append({"op": "causal conv", "impl": name, "shape": text, "fwd_ms": round(fwd, 2),
                         "fwd_bwd_ms": round(both, 2), "error": f"{error:.1e}"})
        del scan_inputs, conv_inputs
        if cuda:
            torch.cuda.empty_cache()
    print("| op | implementation | B x S | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['impl']} | {r['shape']} | {r.get('fwd_ms', '-')} | {r.get('fwd_tflops', '-')} | "
              f"{r.get('fwd_bwd_ms', '-')} | {r.get('fwd_bwd_tflops', '-')} | {r['error']} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
