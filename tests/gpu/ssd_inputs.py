"""Inputs and the error measure of the Mamba-2 scan's GPU tests (tests/gpu/test_ssd_triton_gpu.py for fla-core's
kernels, tests/gpu/test_ssd_mamba_gpu.py for mamba-ssm's)."""

from __future__ import annotations

import math

import torch


def packed_documents(seq: int, seed: int, first_lengths: list[int]) -> torch.Tensor:
    """Document ids (on the GPU) of a packed row: ``first_lengths`` (a one-token document, starts on the kernels'
    chunk edges), then lengths from 1 to ~600, cut at ``seq``."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(first_lengths)
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, 600, (1,), generator=g)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
    return ids.cuda()


def mamba2_scan_inputs(batch: int, seq: int, dtype: torch.dtype, seed: int, heads: int, head_dim: int, groups: int,
                       state: int) -> dict[str, torch.Tensor]:
    """Mamba-2's ranges: dt log-uniform in [1e-3, 1e-1] (its init), A in [-16, -1]; x, B, C ~ N(0, 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cuda = {"device": "cuda", "generator": g}
    dt = torch.exp(torch.rand(batch, seq, heads, **cuda) * math.log(100.0) + math.log(1e-3))
    return {"x_BSHP": torch.randn(batch, seq, heads, head_dim, **cuda).to(dtype), "dt_BSH": dt,
            "A_H": -torch.exp(torch.rand(heads, **cuda) * math.log(16.0)),
            "B_BSGN": torch.randn(batch, seq, groups, state, **cuda).to(dtype),
            "C_BSGN": torch.randn(batch, seq, groups, state, **cuda).to(dtype)}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_without_host_sync(scan, inputs: dict[str, torch.Tensor], chunk_size: int, backward: bool) -> None:
    """``scan(**inputs)`` (and its backward when ``backward``) twice: once plainly (a warm-up: an autotuner times
    its configs then), once under CUDA's sync detection, which raises on any host sync."""
    for strict in (False, True):
        leaves = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            y, final = scan(**leaves, chunk_size=chunk_size)
            if backward:
                (y.float().sum() + final.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
