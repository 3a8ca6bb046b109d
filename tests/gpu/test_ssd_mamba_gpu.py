"""The Mamba-2 mixer's GPU training scan (mamba-ssm's Triton kernels behind
mmtrain/models/nemotron_h/ssd_mamba.py) against the PyTorch reference (ssd.ssd_chunked_scan) on the GPU, skipped
without CUDA or without mamba-ssm: outputs, final states and the gradients of x, dt, A, B, C (and the initial
state) at hybrid-1b's Mamba shape (64 heads of 64, 8 groups, state 128, chunk 128) at 4 x 4096 tokens and on a
ragged packed row of 8192 tokens (documents of 1 to ~600 tokens, starts on and off the 128-token chunk edges, with
an initial state), in fp32 and bf16; the scan makes no host sync; the mixer's ``ssd_scan`` sends a CUDA scan that
needs gradients to mamba-ssm (and would send one that does not to fla).

Autotuning: the first test runs the configuration training runs (bf16, whole rows, no initial state) with
mamba-ssm's full autotuning (~120 kernel configs compiled, on the order of a minute or two the first time; Triton's
disk cache keeps them for the benchmark and training processes that follow); the others check values, not speed,
and run each kernel's smallest config (tests/triton_interpreter.pin_smallest_mamba_configs), one compile per
kernel and mode.

Errors are norm-relative, ||kernel - reference|| / ||reference||, the reference in fp32 math on the same inputs
(bf16 inputs rounded once for both). Tolerances, as for fla's kernels (tests/gpu/test_ssd_triton_gpu.py):
- fp32 inputs: mamba-ssm's ``tl.dot`` runs fp32 operands as TF32 on NVIDIA (10-bit mantissa, unit roundoff 2^-11 =
  4.9e-4 per operand), so products carry ~1e-3 relative error that random signs average down in the sums:
  expected ~1e-3, bound 5e-3; dt's and A's gradients are sums of cancelling terms over every token (dA over B*S of
  them): 1e-2.
- bf16 inputs: the kernels feed their dots in bf16 (2^-9 = 2e-3): the chunk states passed between chunks, the
  state gradients, dt*x; C.B stays fp32; a few independent 2e-3 roundings: expected ~5e-3, bound 2e-2; dt and A
  5e-2.
Each test prints its errors (``pytest -s``: lines starting ``ssd-errors``) so a run shows the margins.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.nemotron_h import ssd
from mmtrain.models.nemotron_h.ssd import ssd_chunked_scan
from mmtrain.models.nemotron_h.ssd_mamba import mamba_ssd_available, ssd_chunked_scan_mamba
from tests.gpu.ssd_inputs import mamba2_scan_inputs, packed_documents, relative, run_without_host_sync


pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not mamba_ssd_available(), reason="needs mamba-ssm's Triton kernels")]

HEADS, P, GROUPS, N, CHUNK = 64, 64, 8, 128, 128  # hybrid-1b's Mamba layers
TOLERANCE = {torch.float32: (5e-3, 1e-2), torch.bfloat16: (2e-2, 5e-2)}  # (most tensors, dt and A gradients)
GRADS = ["x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN"]


@pytest.fixture
def smallest_configs():
    from tests.triton_interpreter import pin_smallest_mamba_configs

    restore = pin_smallest_mamba_configs()
    yield
    restore()


def _documents(seq: int, seed: int) -> torch.Tensor:
    """Document ids of a packed row: lengths from 1 to ~600 (a one-token document, starts on and off the
    128-token chunk edges), cut at ``seq``."""
    return packed_documents(seq, seed, [1, 127, 128, 256, 7])


def _scan_inputs(batch: int, seq: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    return mamba2_scan_inputs(batch, seq, dtype, seed, HEADS, P, GROUPS, N)


def _packed_inputs(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    inputs = _scan_inputs(1, 8192, dtype, seed)
    inputs["doc_ids_BS"] = _documents(8192, seed + 1)[None]
    inputs["initial_state_BHPN"] = torch.randn(1, HEADS, P, N, device="cuda")
    return inputs


def _run(fn, inputs: dict, grads: list[str], cotangents: list[torch.Tensor] | None):
    """fn's outputs and the gradients of sum(output * cotangent) for the named inputs."""
    leaves = {k: (v.clone().requires_grad_(True) if k in grads else v) for k, v in inputs.items()}
    outputs = fn(**leaves, chunk_size=CHUNK)
    if cotangents is None:
        cotangents = [torch.randn_like(o, dtype=torch.float32) for o in outputs]
    sum((o.float() * c).sum() for o, c in zip(outputs, cotangents)).backward()
    return outputs, {k: leaves[k].grad for k in grads}, cotangents


def _compare(name: str, inputs: dict, grads: list[str], dtype: torch.dtype) -> None:
    out_k, grad_k, cot = _run(ssd_chunked_scan_mamba, inputs, grads, None)
    out_r, grad_r, _ = _run(ssd_chunked_scan, inputs, grads, cot)
    assert [o.dtype for o in out_k] == [o.dtype for o in out_r]
    assert all(grad_k[k].dtype == inputs[k].dtype for k in grads)
    errors = {f"out{i}": relative(a, b) for i, (a, b) in enumerate(zip(out_k, out_r))}
    errors.update({f"d{k}": relative(grad_k[k], grad_r[k]) for k in grads})
    print(f"ssd-errors mamba {name} {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    bound, loose = TOLERANCE[dtype]
    for key, error in errors.items():
        assert error < (loose if key in ("ddt_BSH", "dA_H") else bound), (name, key, errors)


def test_scan_equals_the_reference_as_training_runs_it():
    """bf16, 4 x 4096, whole rows, no initial state: the configuration the hybrid's training runs, autotuned."""
    _compare("4x4096", _scan_inputs(4, 4096, torch.bfloat16, seed=0), GRADS, torch.bfloat16)


def test_scan_equals_the_reference_in_fp32(smallest_configs):
    _compare("4x4096", _scan_inputs(4, 4096, torch.float32, seed=1), GRADS, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ragged_packed_row_with_an_initial_state_equals_the_reference(smallest_configs, dtype):
    _compare("1x8192 packed+state", _packed_inputs(dtype, seed=2), GRADS + ["initial_state_BHPN"], dtype)


def test_the_scan_makes_no_host_sync(smallest_configs):
    """Documents and an initial state included: forward and backward under CUDA's sync detection (after one
    warm-up call: an autotuner would time its configs then)."""
    inputs = _scan_inputs(2, 1024, torch.bfloat16, seed=6)
    inputs["doc_ids_BS"] = torch.stack([_documents(1024, 7), _documents(1024, 8)])
    inputs["initial_state_BHPN"] = torch.randn(2, HEADS, P, N, device="cuda")
    run_without_host_sync(ssd_chunked_scan_mamba, inputs, CHUNK, backward=True)


def test_the_mixer_scan_takes_mamba_for_gradients_and_fla_without(smallest_configs, monkeypatch):
    """(fla's kernels are not run here: their autotuning is tests/gpu/test_ssd_triton_gpu.py's cost.) The call is
    seen, not inferred from equal outputs: the autograd path's kernels may autotune to another configuration than
    a no-grad call's and differ from it by a bf16 ulp (H200, 2026-12-04)."""
    inputs = _scan_inputs(1, 512, torch.bfloat16, seed=9)
    inputs["doc_ids_BS"] = _documents(512, 10)[None]
    assert ssd.scan_backend(inputs["x_BSHP"], needs_grad=False) == "fla"
    assert ssd.scan_backend(inputs["x_BSHP"], needs_grad=True) == "mamba"
    with torch.no_grad():
        y_mamba = ssd_chunked_scan_mamba(**inputs, chunk_size=CHUNK)[0]
    calls = []
    monkeypatch.setattr(ssd, "ssd_chunked_scan_mamba",
                        lambda *args, **kw: calls.append(1) or ssd_chunked_scan_mamba(*args, **kw))
    inputs["x_BSHP"].requires_grad_(True)
    y = ssd.ssd_scan(**inputs, chunk_size=CHUNK)[0]
    assert calls == [1]
    torch.testing.assert_close(y, y_mamba, rtol=2e-2, atol=2e-2)
