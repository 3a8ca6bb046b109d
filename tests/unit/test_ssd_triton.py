"""The GPU paths of the Mamba-2 mixer (mmtrain/models/nemotron_h/ssd_triton.py, conv_triton.py) without a GPU:
fla-core's own Triton kernels run under Triton's CPU interpreter (tests/triton_interpreter.py) and equal the
PyTorch references (ssd.ssd_chunked_scan, mixer.causal_conv) in fp32 -- outputs, final state and every gradient,
with groups, packed documents (starts inside and on fla's chunk edges, a one-token document) and an initial state.
The public functions refuse CPU tensors and bad shapes in one line; a missing fla-core is one line too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmtrain.models.nemotron_h import conv_triton, ssd_triton

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_fla_kernels_equal_the_references_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.triton_interpreter"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"scan_docs_state", "scan_plain", "conv_docs", "conv_plain"}
    assert set(report["scan_docs_state"]) == {"out0", "out1", "dx_BSHP", "ddt_BSH", "dA_H", "dB_BSGN", "dC_BSGN",
                                              "dinitial_state_BHPN"}
    # exact fp32 dots on both sides: only the chunking and the order of the sums differ (a wrong layout, gate,
    # state orientation or document reset is an O(1) error)
    worst = {case: max(errors.values()) for case, errors in report.items()}
    assert all(error < 1e-4 for error in worst.values()), report


def _scan_inputs(batch=2, seq=8, heads=4, p=3, groups=2, n=5):
    return (torch.randn(batch, seq, heads, p), torch.rand(batch, seq, heads), -torch.rand(heads),
            torch.randn(batch, seq, groups, n), torch.randn(batch, seq, groups, n))


def test_the_scan_refuses_cpu_tensors_in_one_line():
    cpu = r"runs on CUDA tensors in fp32, bf16 or fp16, got x in torch.float32 on cpu; use ssd\.ssd_chunked_scan"
    with pytest.raises(ValueError, match=cpu) as err:
        ssd_triton.ssd_chunked_scan_triton(*_scan_inputs(), 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(dt=torch.rand(2, 8, 3)), r"dt must have shape \(2, 8, 4\)"),
    (lambda a: a.update(A=torch.rand(2)), r"A must have shape \(4,\)"),
    (lambda a: a.update(C=torch.randn(2, 8, 2, 6)), r"C must have shape \(2, 8, 2, 5\)"),
    (lambda a: a.update(B=torch.randn(2, 7, 2, 5)), r"B must be \(batch=2, seq=8, groups, state\)"),
    (lambda a: a.update(B=torch.randn(2, 8, 3, 5), C=torch.randn(2, 8, 3, 5)), r"heads \(4\) must be a multiple"),
    (lambda a: a.update(doc_ids=torch.zeros(2, 7, dtype=torch.long)), r"doc_ids must have shape \(2, 8\)"),
    (lambda a: a.update(doc_ids=torch.zeros(2, 8)), r"doc_ids must be an integer tensor"),
    (lambda a: a.update(state=torch.zeros(2, 4, 5, 3)), r"initial_state must have shape \(2, 4, 3, 5\)"),
    (lambda a: a.update(chunk=0), r"chunk_size must be a positive int, got 0"),
    (lambda a: a.update(x=torch.randn(2, 8, 12)), r"x must be \(batch, seq, heads, head_dim\)"),
])
def test_the_scan_names_the_argument_that_does_not_fit(change, message):
    x, dt, A, B, C = _scan_inputs()
    args = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "chunk": 4, "doc_ids": None, "state": None}
    change(args)
    with pytest.raises(ValueError, match=message) as err:
        ssd_triton.ssd_chunked_scan_triton(args["x"], args["dt"], args["A"], args["B"], args["C"], args["chunk"],
                                           args["doc_ids"], args["state"])
    assert "\n" not in str(err.value)


def test_the_convolution_refuses_cpu_tensors_and_bad_shapes_in_one_line():
    x, w, b = torch.randn(2, 8, 6), torch.randn(6, 1, 4), torch.randn(6)
    with pytest.raises(ValueError, match=r"fp32, bf16 or fp16, got x in torch.float32 on cpu; use mixer\.causal_conv"):
        conv_triton.causal_conv_triton(x, w, b)
    with pytest.raises(ValueError, match=r"weight must be \(6, 1, kernel\), got \(6, 4\)"):
        conv_triton.causal_conv_triton(x, w[:, 0], b)
    with pytest.raises(ValueError, match=r"doc_ids must be \(2, 8\), got \(8,\)"):
        conv_triton.causal_conv_triton(x, w, b, torch.zeros(8, dtype=torch.long))


def test_a_missing_fla_core_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", None)
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", None)
    for load in (ssd_triton.load_chunk_simple_gla, conv_triton.load_causal_conv1d):
        with pytest.raises(ImportError, match=r"needs fla-core 0\.6 \(pip install fla-core==0\.6\.0\)") as err:
            load()
        assert "\n" not in str(err.value)
