"""The mamba-ssm GPU scan (mmtrain/models/nemotron_h/ssd_mamba.py) without a GPU: mamba-ssm's own Triton kernels
run under Triton's CPU interpreter (tests/triton_interpreter.py, ``mamba`` mode) and equal the PyTorch reference
(ssd.ssd_chunked_scan) in fp32 -- output, final state and the gradients of x, dt, A, B, C and the initial state,
with groups, packed documents (a start inside the first chunk, starts on chunk edges, a one-token document, a row
whose first document id is not 0) and an initial state; and the scan inside a ``torch.compile(fullgraph=True)``
graph equals the eager call. Skipped where mamba-ssm is not installed (CI). Without it: the loader's one-line
errors, the public function's refusals and ``ssd.scan_backend``'s choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmtrain.models.nemotron_h import ssd, ssd_mamba

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not ssd_mamba.mamba_ssd_available(),
                    reason=f"mamba-ssm is not installed ({ssd_mamba.INSTALL_HINT})")
def test_mamba_kernels_equal_the_reference_under_the_triton_interpreter():
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "tests.triton_interpreter", "mamba"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"scan_docs_state", "scan_plain", "compiled_vs_eager"}
    assert set(report["scan_docs_state"]) == {"out0", "out1", "dx_BSHP", "ddt_BSH", "dA_H", "dB_BSGN", "dC_BSGN",
                                              "dinitial_state_BHPN"}
    assert set(report["compiled_vs_eager"]) == {"out0", "dx_BSHP", "ddt_BSH", "dA_H", "dB_BSGN", "dC_BSGN",
                                                "dinitial_state_BHPN"}
    # exact fp32 dots on both sides: only the chunk lengths (32 against 16) and the order of the sums differ (a
    # wrong layout, document index, state reset or dt clamp is an O(1) error)
    worst = {case: max(errors.values()) for case, errors in report.items()}
    assert all(error < 1e-5 for error in worst.values()), report


def test_the_document_index_counts_starts_from_zero():
    doc_ids = torch.tensor([[7, 7, 8, 8, 8, 9], [0, 1, 1, 1, 1, 1]])
    assert ssd_mamba.document_index(doc_ids).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert ssd_mamba.document_index(doc_ids).dtype == torch.int32


@pytest.mark.parametrize("chunk, kernel", [(128, 128), (16, 16), (256, 256), (8, 128), (96, 128), (512, 128)])
def test_the_kernel_chunk_length(chunk, kernel):
    assert ssd_mamba.kernel_chunk_size(chunk) == kernel


def _write_package(root: Path, name: str, init: str, modules: dict[str, str]) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(init)
    for module, text in modules.items():
        (root / name / f"{module}.py").write_text(text)


def test_the_loader_skips_the_package_init_and_leaves_no_stand_in(tmp_path, monkeypatch):
    _write_package(tmp_path, "mmtest_pkg_a", "raise ImportError('no CUDA extension')\n", {"ops": "VALUE = 3\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = ssd_mamba.import_skipping_package_init("mmtest_pkg_a", "ops")
        assert module.VALUE == 3
        assert "mmtest_pkg_a" not in sys.modules  # the stand-in is gone: a later import runs the real __init__
        assert ssd_mamba.import_skipping_package_init("mmtest_pkg_a", "ops") is module
    finally:
        sys.modules.pop("mmtest_pkg_a.ops", None)


def test_a_missing_or_broken_mamba_ssm_is_one_line(tmp_path, monkeypatch):
    hint = r"\(pip install wheel; MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation"
    with pytest.raises(ImportError, match=r"mmtest_missing\.ops\.triton cannot be imported: it is not installed "
                                          + hint) as err:
        ssd_mamba.import_skipping_package_init("mmtest_missing", "ops.triton")
    assert "\n" not in str(err.value)
    _write_package(tmp_path, "mmtest_pkg_b", "", {"ops": "import mmtest_not_there\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"importing mmtest_pkg_b\.ops failed: ModuleNotFoundError: No module "
                                          r"named 'mmtest_not_there'") as err:
        ssd_mamba.import_skipping_package_init("mmtest_pkg_b", "ops")
    assert "\n" not in str(err.value) and "mmtest_pkg_b" not in sys.modules


def test_load_names_what_the_scan_needs(monkeypatch):
    monkeypatch.setattr(ssd_mamba, "_ssd_combined_or_reason", lambda: "mamba_ssm.x cannot be imported: reason")
    with pytest.raises(ImportError, match=r"^the GPU training scan needs mamba-ssm's Triton kernels: mamba_ssm\.x"):
        ssd_mamba.load_mamba_ssd()


def _scan_inputs(batch=2, seq=8, heads=4, p=3, groups=2, n=5):
    return (torch.randn(batch, seq, heads, p), torch.rand(batch, seq, heads), -torch.rand(heads),
            torch.randn(batch, seq, groups, n), torch.randn(batch, seq, groups, n))


def test_the_public_scan_refuses_cpu_tensors_and_bad_shapes_in_one_line():
    with pytest.raises(ValueError, match=r"ssd_chunked_scan_mamba runs on CUDA tensors in fp32, bf16 or fp16, got x "
                                         r"in torch.float32 on cpu; use ssd\.ssd_chunked_scan") as err:
        ssd_mamba.ssd_chunked_scan_mamba(*_scan_inputs(), 16)
    assert "\n" not in str(err.value)
    x, dt, A, B, C = _scan_inputs()
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 4, 3, 5\)"):
        ssd_mamba.ssd_chunked_scan_mamba(x, dt, A, B, C, 16, None, torch.zeros(2, 4, 5, 3))
    with pytest.raises(ValueError, match=r"doc_ids must be an integer tensor"):
        ssd_mamba.ssd_chunked_scan_mamba(x, dt, A, B, C, 16, torch.zeros(2, 8))


class _FakeCuda:
    """What ``scan_backend`` reads of x: its device kind and dtype."""

    def __init__(self, dtype=torch.bfloat16, is_cuda=True):
        self.dtype, self.is_cuda = dtype, is_cuda


@pytest.mark.parametrize("mamba, fla_trusted, x, needs_grad, expected", [
    (True, True, _FakeCuda(), True, "mamba"),
    (True, False, _FakeCuda(torch.float32), True, "mamba"),
    (False, True, _FakeCuda(), True, "fla"),
    (False, False, _FakeCuda(), True, "reference"),  # Hopper with torch 2.11's Triton, no mamba-ssm
    (True, False, _FakeCuda(), False, "fla"),  # decoding keeps fla's forward
    (True, True, _FakeCuda(torch.float64), True, "reference"),
    (True, True, _FakeCuda(is_cuda=False), True, "reference"),
])
def test_the_scan_backend(monkeypatch, mamba, fla_trusted, x, needs_grad, expected):
    monkeypatch.setattr(ssd, "mamba_ssd_available", lambda: mamba)
    monkeypatch.setattr(ssd, "fla_backward_trusted", lambda: fla_trusted)
    assert ssd.scan_backend(x, needs_grad) == expected


def test_cpu_scans_take_the_reference():
    x, dt, A, B, C = (t.requires_grad_(True) for t in _scan_inputs())
    y, final = ssd.ssd_scan(x, dt, A, B, C, 4)
    y_ref, final_ref = ssd.ssd_chunked_scan(x, dt, A, B, C, 4)
    assert y.equal(y_ref) and final.equal(final_ref)
