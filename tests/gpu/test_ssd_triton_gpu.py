"""The Mamba-2 mixer's GPU kernels (fla-core's Triton kernels behind mmtrain/models/nemotron_h/ssd_triton.py and
conv_triton.py) against the PyTorch references (ssd.ssd_chunked_scan, mixer.causal_conv) on the GPU, skipped
without CUDA: outputs, final states and the gradients of x, dt, A, B, C (and the initial state) at the ~1B
shape's head_dim 64 and state 128, 4096 tokens, in fp32 and bf16; a ragged packed row equals its documents run one
by one; the scan makes no host sync; the mixer's ``ssd_scan`` sends CUDA tensors to the kernel (fp64 to the
reference).

Errors are norm-relative, ||kernel - reference|| / ||reference||, the reference in fp32 math on the same inputs
(bf16 inputs rounded once for both). Tolerances:
- fp32 inputs: fla's ``tl.dot`` runs fp32 operands as TF32 on NVIDIA (10-bit mantissa, unit roundoff 2^-11 = 4.9e-4
  per operand), so products carry ~1e-3 relative error that random signs average down in the sums: expected
  ~1e-3, bound 5e-3; dt's and A's gradients are sums of cancelling terms over every token (dA over B*S of them):
  1e-2.
- bf16 inputs: besides the inputs (the same for both), the kernel rounds to bf16 (2^-9 = 2e-3) what it feeds its
  dots: dt*x, the decayed scores, the per-chunk states and the decayed values; a few independent 2e-3 roundings:
  expected ~5e-3, bound 2e-2; dt and A 5e-2.
Each test prints its errors (``pytest -s``: lines starting ``ssd-errors``) so a run shows the margins.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.nemotron_h import ssd
from mmtrain.models.nemotron_h.conv_triton import causal_conv_triton
from mmtrain.models.nemotron_h.mixer import causal_conv
from mmtrain.models.nemotron_h.ssd import ssd_chunked_scan
from mmtrain.models.nemotron_h.ssd_triton import fla_backward_trusted, ssd_chunked_scan_triton
from tests.gpu.ssd_inputs import mamba2_scan_inputs, packed_documents, relative, run_without_host_sync


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, P, GROUPS, N, CHUNK = 32, 64, 8, 128, 128  # the ~1B's head_dim, state and chunk; 4 heads per group
TOLERANCE = {torch.float32: (5e-3, 1e-2), torch.bfloat16: (2e-2, 5e-2)}  # (most tensors, dt and A gradients)


def _documents(seq: int, seed: int) -> torch.Tensor:
    """Document ids of a packed row: lengths from 1 to ~600 (a one-token document, starts on 64- and 128-token
    chunk edges), cut at ``seq``."""
    return packed_documents(seq, seed, [1, 63, 64, 128, 7])


def _scan_inputs(batch: int, seq: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    return mamba2_scan_inputs(batch, seq, dtype, seed, HEADS, P, GROUPS, N)


def _run(fn, inputs: dict, grads: list[str], cotangents: list[torch.Tensor] | None, **fixed):
    """fn's outputs and the gradients of sum(output * cotangent) for the named inputs."""
    leaves = {k: (v.clone().requires_grad_(True) if k in grads else v) for k, v in inputs.items()}
    outputs = fn(**leaves, **fixed)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if cotangents is None:
        cotangents = [torch.randn_like(o, dtype=torch.float32) for o in outputs]
    if grads:
        sum((o.float() * c).sum() for o, c in zip(outputs, cotangents)).backward()
    return outputs, {k: leaves[k].grad for k in grads}, cotangents


def _compare(name: str, kernel, reference, inputs: dict, grads: list[str], dtype: torch.dtype, **fixed) -> None:
    if not fla_backward_trusted():  # Hopper with torch 2.11's Triton: fla refuses its backward (ssd_triton)
        grads = []
    out_k, grad_k, cot = _run(kernel, inputs, grads, None, **fixed)
    out_r, grad_r, _ = _run(reference, inputs, grads, cot, **fixed)
    assert [o.dtype for o in out_k] == [o.dtype for o in out_r]
    errors = {f"out{i}": relative(a, b) for i, (a, b) in enumerate(zip(out_k, out_r))}
    errors.update({f"d{k}": relative(grad_k[k], grad_r[k]) for k in grads})
    print(f"ssd-errors {name} {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    bound, loose = TOLERANCE[dtype]
    for key, error in errors.items():
        assert error < (loose if key in ("ddt_BSH", "dA_H") else bound), (name, key, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_equals_the_reference_with_documents_and_states(dtype):
    inputs = _scan_inputs(2, 4096, dtype, seed=0)
    inputs["doc_ids_BS"] = torch.stack([_documents(4096, 1), _documents(4096, 2)])
    inputs["initial_state_BHPN"] = torch.randn(2, HEADS, P, N, device="cuda")
    grads = ["x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN", "initial_state_BHPN"]
    _compare("scan+documents+state", ssd_chunked_scan_triton, ssd_chunked_scan, inputs, grads, dtype,
             chunk_size=CHUNK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_equals_the_reference_on_whole_rows(dtype):
    inputs = _scan_inputs(2, 4096, dtype, seed=3)
    _compare("scan", ssd_chunked_scan_triton, ssd_chunked_scan, inputs, ["x_BSHP", "dt_BSH", "A_H", "B_BSGN",
                                                                        "C_BSGN"], dtype, chunk_size=CHUNK)


def test_a_ragged_packed_row_equals_its_documents_one_by_one():
    """1,037 tokens (no multiple of 64) of documents of 1 to 600 tokens: the packed kernel's output and final
    state equal the kernel run on each document alone (its own row, from a zero state)."""
    seq = 1037
    inputs = _scan_inputs(1, seq, torch.float32, seed=4)
    doc_ids = _documents(seq, 5)[None]
    y, final = ssd_chunked_scan_triton(**inputs, chunk_size=CHUNK, doc_ids_BS=doc_ids)
    pieces, last_final = [], None
    for doc in torch.unique(doc_ids):
        where = (doc_ids[0] == doc).nonzero().flatten()
        alone = {k: (v[:, where] if k != "A_H" else v) for k, v in inputs.items()}
        y_doc, last_final = ssd_chunked_scan_triton(**alone, chunk_size=CHUNK)
        pieces.append(y_doc)
    errors = {"y": relative(y, torch.cat(pieces, dim=1)), "final": relative(final, last_final)}
    print(f"ssd-errors packed-vs-one-by-one: {errors}")
    assert max(errors.values()) < 5e-3, errors  # TF32 rounding on differently placed chunks, see the docstring


def test_the_scan_makes_no_host_sync():
    """Documents and an initial state included: forward and backward under CUDA's sync detection (after one
    warm-up call: fla's autotuner times its configs then)."""
    inputs = _scan_inputs(2, 1024, torch.bfloat16, seed=6)
    inputs["doc_ids_BS"] = torch.stack([_documents(1024, 7), _documents(1024, 8)])
    inputs["initial_state_BHPN"] = torch.randn(2, HEADS, P, N, device="cuda")
    run_without_host_sync(ssd_chunked_scan_triton, inputs, CHUNK, backward=fla_backward_trusted())


def test_the_mixer_scan_sends_cuda_tensors_to_the_kernel():
    inputs = _scan_inputs(1, 512, torch.bfloat16, seed=9)
    inputs["doc_ids_BS"] = _documents(512, 10)[None]
    y_mixer, final_mixer = ssd.ssd_scan(**inputs, chunk_size=CHUNK)
    y_kernel, final_kernel = ssd_chunked_scan_triton(**inputs, chunk_size=CHUNK)
    assert y_mixer.equal(y_kernel) and final_mixer.equal(final_kernel)
    assert not y_mixer.equal(ssd_chunked_scan(**inputs, chunk_size=CHUNK)[0])  # the reference rounds elsewhere
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}  # fp64: the reference's
    assert ssd.ssd_scan(**wide, chunk_size=CHUNK)[0].equal(ssd_chunked_scan(**wide, chunk_size=CHUNK)[0])


def test_a_scan_needing_gradients_takes_the_reference_where_fla_backward_is_not_trusted():
    inputs = _scan_inputs(1, 512, torch.bfloat16, seed=11)
    inputs["x_BSHP"].requires_grad_(True)
    y = ssd.ssd_scan(**inputs, chunk_size=CHUNK)[0]
    expect = (ssd_chunked_scan_triton if fla_backward_trusted() else ssd_chunked_scan)(**inputs, chunk_size=CHUNK)[0]
    assert y.equal(expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
def test_convolution_equals_the_reference(dtype, documents):
    """The mixer's conv width (x|B|C channels of the ~1B: 2 x 2048 + 2 x 8 x 128) and kernel 4."""
    g = torch.Generator(device="cuda").manual_seed(11)
    batch, seq, channels = 2, 4096, 4096 + 2 * 8 * 128
    inputs = {"x_BSC": torch.randn(batch, seq, channels, device="cuda", generator=g).to(dtype),
              "weight_C1K": (torch.randn(channels, 1, 4, device="cuda", generator=g) * 0.5).to(dtype),
              "bias_C": torch.randn(channels, device="cuda", generator=g).to(dtype),
              "doc_ids_BS": torch.stack([_documents(seq, 12), _documents(seq, 13)]) if documents else None}
    _compare(f"conv documents={documents}", causal_conv_triton, causal_conv, inputs, ["x_BSC", "weight_C1K",
                                                                                      "bias_C"], dtype)
