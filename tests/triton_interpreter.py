"""fla-core's and mamba-ssm's Triton kernels on the CPU, under Triton's interpreter, for the tests that check the GPU
paths' conventions on a machine without a GPU (tests/unit/test_ssd_triton.py runs
``python -m tests.triton_interpreter``, tests/unit/test_ssd_mamba.py ``python -m tests.triton_interpreter mamba``,
in a child process started with TRITON_INTERPRET=1; the interpreter is chosen when Triton is imported).

Triton 3.6's interpreter runs fla's kernels once three gaps are bridged here (test code only; nothing in mmtrain
knows of it), mmtrain's decode attention kernel once a fourth is:
- autotuning times each config through the GPU driver, and there is none: every config is timed alike, so the
  first one runs;
- a scalar kernel argument is a one-element array, which NumPy 2 refuses as an index (``range(NT)``): its item is
  taken;
- ``range`` in an interpreted kernel yields Python ints where compiled Triton yields tensors (fla writes
  ``i_t.to(tl.int64)``): while a kernel runs, its module's ``range`` yields interpreter tensors;
- bf16 tiles are stored as uint16, and ``tl.dot`` multiplied them as integers: they are widened to fp32 first.

The interpreter computes fp32 dots exactly (no TF32) and has no bf16, so this checks layouts, gates, states,
document resets and gradients in fp32; precision on the GPU is tests/gpu/test_ssd_triton_gpu.py's business.

mamba-ssm's kernels need two more (``enable_mamba``: its host code's CUDA device queries, and its autotune configs
cut to the smallest one, which NumPy runs in seconds).

``run_interpreted`` runs a test's own script that way (tests/unit/test_fp8_gemv.py, test_decode_attention.py).

Run as a program it prints one JSON line: the relative error of each output and gradient of the fla-backed scan
(``ssd_triton.fla_scan``) and convolution (``conv_triton.fla_causal_conv``) against the PyTorch references; with
the argument ``mamba``, of the mamba-ssm-backed scan (``ssd_mamba.mamba_scan``), eager and compiled.
"""

from __future__ import annotations

import builtins
import json
import os

import numpy as np


def enable() -> None:
    """Patch Triton's interpreter as the module docstring says (call before running a kernel)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("start the process with TRITON_INTERPRET=1 (Triton reads it when it is imported)")
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    autotuner.Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles: [1.0, 1.0, 1.0])

    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_item_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_item_index

    def tensor_range(*bounds):
        ints = [int(np.asarray(b.handle.data).reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds]
        for i in builtins.range(*ints):
            yield interpreter._implicit_cvt(i)

    run_grid = interpreter.GridExecutor.__call__

    def run_with_tensor_range(self, *args, **kwargs):
        module_globals = self.fn.__globals__
        saved = module_globals.get("range", None)
        module_globals["range"] = tensor_range
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            if saved is None:
                del module_globals["range"]
            else:
                module_globals["range"] = saved

    interpreter.GridExecutor.__call__ = run_with_tensor_range

    import triton.language as tl

    def widened(h):
        if h.dtype != tl.bfloat16:
            return h
        data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    dot = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, widened(a), widened(b), d,
                                                                                 *rest)


def run_interpreted(child: str) -> None:
    """Run the script ``child`` in a child process with ``TRITON_INTERPRET=1`` (it may call ``enable``); it must
    print "ok". Skips when the interpreter cannot run here at all (an error that is neither the interpreter's
    report of a kernel nor a failed assertion)."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton", reason="the kernel is written in Triton")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", child], check=False, cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0 and "InterpreterError" not in out.stderr and "AssertionError" not in out.stderr:
        pytest.skip(f"Triton's interpreter cannot run here: {out.stderr.strip().splitlines()[-1][:200]}")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _relative(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(fn_a, fn_b, inputs, grad_names, seed: int) -> dict[str, float]:
    """Relative errors of fn_a against fn_b on the same inputs: every output, then the gradients of a random
    linear function of the outputs with respect to ``grad_names``."""
    import torch

    errors, grads = {}, []
    outputs = []
    for fn in (fn_a, fn_b):
        leaves = {k: (v.clone().requires_grad_(True) if k in grad_names else v) for k, v in inputs.items()}
        out = fn(**leaves)
        out = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(seed)
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
        loss.backward()
        outputs.append(out)
        grads.append({k: leaves[k].grad for k in grad_names})
    for i, (a, b) in enumerate(zip(*outputs)):
        errors[f"out{i}"] = _relative(a, b)
    for k in grad_names:
        errors[f"d{k}"] = _relative(grads[0][k], grads[1][k])
    return errors


def main() -> None:
    enable()
    import torch
    import torch.nn.functional as F

    from mmtrain.models.nemotron_h import conv_triton, ssd, ssd_triton
    from mmtrain.models.nemotron_h.mixer import causal_conv

    torch.manual_seed(0)
    b, s, h, p, g, n = 2, 150, 4, 16, 2, 32
    # documents: starts inside a chunk, on fla's 64-token chunk edges (64, 128), a one-token document
    doc_ids = torch.tensor([[0] * 40 + [1] * 3 + [2] * 21 + [3] * 64 + [4] * 22,
                            [5] * 70 + [6] * 1 + [7] * 57 + [8] * 22])
    scan_inputs = {
        "x_BSHP": torch.randn(b, s, h, p), "dt_BSH": F.softplus(torch.randn(b, s, h) - 1.0),
        "A_H": -(torch.rand(h) * 4 + 0.5), "B_BSGN": torch.randn(b, s, g, n), "C_BSGN": torch.randn(b, s, g, n),
        "doc_ids_BS": doc_ids, "initial_state_BHPN": torch.randn(b, h, p, n),
    }
    kernel = ssd_triton.load_chunk_simple_gla()

    def fla(**kw):
        return ssd_triton.fla_scan(kernel, *(kw[k] for k in ("x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN",
                                                             "doc_ids_BS", "initial_state_BHPN")))

    def reference(**kw):
        return ssd.ssd_chunked_scan(chunk_size=32, **kw)

    report = {"scan_docs_state": _compare(fla, reference, scan_inputs,
                                          ["x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN", "initial_state_BHPN"], 1)}
    plain = {k: v[:, :100] if k != "A_H" and k != "initial_state_BHPN" else v for k, v in scan_inputs.items()}
    plain.update(doc_ids_BS=None, initial_state_BHPN=None)
    report["scan_plain"] = _compare(fla, reference, plain, ["x_BSHP", "dt_BSH", "A_H"], 2)

    c, k = 24, 4
    conv_inputs = {"x_BSC": torch.randn(b, s, c), "weight_C1K": torch.randn(c, 1, k), "bias_C": torch.randn(c),
                   "doc_ids_BS": doc_ids}
    conv = conv_triton.load_causal_conv1d()

    def fla_conv(**kw):
        return conv_triton.fla_causal_conv(conv, **kw)

    names = ["x_BSC", "weight_C1K", "bias_C"]
    report["conv_docs"] = _compare(fla_conv, causal_conv, conv_inputs, names, 3)
    report["conv_plain"] = _compare(fla_conv, causal_conv, {**conv_inputs, "doc_ids_BS": None}, names, 4)
    print(json.dumps(report))


def pin_smallest_mamba_configs():
    """Cut every autotuner of mamba-ssm's Triton kernels to its smallest config (the product of its block sizes
    times its stages: one that fits any GPU) and return the function that restores them. A one-config autotuner
    neither times nor compiles others: the CPU interpreter runs small blocks fast, and GPU tests that check values,
    not speed, compile one config per kernel instead of ~8."""
    import math
    import sys

    import triton.runtime.autotuner as autotuner

    from mmtrain.models.nemotron_h import ssd_mamba

    ssd_mamba.load_mamba_ssd()

    def cost(config) -> int:
        blocks = [v for k, v in config.kwargs.items() if k.startswith("BLOCK_SIZE")]
        return math.prod(blocks) * (config.num_stages or 1)

    saved = []
    for name, module in list(sys.modules.items()):
        if name.startswith("mamba_ssm.ops.triton"):
            for value in vars(module).values():
                if isinstance(value, autotuner.Autotuner) and len(value.configs) > 1:
                    saved.append((value, value.configs))
                    value.configs = [min(value.configs, key=cost)]

    def restore() -> None:
        for tuner, configs in saved:
            tuner.configs = configs

    return restore


def enable_mamba() -> None:
    """What mamba-ssm's kernels need on top of ``enable``: its host code enters ``torch.cuda.device(x.device.index)``
    around each launch, which a machine without CUDA refuses (a no-op here: the interpreter runs on the CPU), and
    reads the GPU's multiprocessor count to split some backward work (an H200's 132 here); its big autotune configs
    (up to 128 x 256 blocks, the first one run here) take minutes in NumPy: ``pin_smallest_mamba_configs``."""
    import contextlib
    import types

    import torch

    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=132)
    pin_smallest_mamba_configs()


def main_mamba() -> None:
    """mamba-ssm's scan (``ssd_mamba.mamba_scan``, through its custom op) against the reference: one JSON line."""
    enable()
    enable_mamba()
    import torch
    import torch.nn.functional as F

    from mmtrain.models.nemotron_h import ssd, ssd_mamba

    torch.manual_seed(0)
    b, s, h, p, g, n, chunk = 2, 100, 4, 16, 2, 16, 32
    # documents: row 0 starts inside chunk 0 (the initial state's document ends there), on the 32- and 64-token
    # chunk edges, a one-token document; row 1's first document (id 5, not 0) crosses two chunk edges
    doc_ids = torch.tensor([[0] * 20 + [1] * 12 + [2] * 1 + [3] * 31 + [4] * 36,
                            [5] * 70 + [6] * 1 + [7] * 29])
    scan_inputs = {
        "x_BSHP": torch.randn(b, s, h, p), "dt_BSH": F.softplus(torch.randn(b, s, h) - 1.0),
        "A_H": -(torch.rand(h) * 4 + 0.5), "B_BSGN": torch.randn(b, s, g, n), "C_BSGN": torch.randn(b, s, g, n),
        "doc_ids_BS": doc_ids, "initial_state_BHPN": torch.randn(b, h, p, n),
    }
    names = ("x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN", "doc_ids_BS", "initial_state_BHPN")

    def mamba(**kw):
        return ssd_mamba.mamba_scan(*(kw[k] for k in names[:5]), chunk, kw["doc_ids_BS"], kw["initial_state_BHPN"])

    def reference(**kw):
        return ssd.ssd_chunked_scan(chunk_size=16, **kw)  # another chunk length: the decomposition is exact

    grads = ["x_BSHP", "dt_BSH", "A_H", "B_BSGN", "C_BSGN", "initial_state_BHPN"]
    report = {"scan_docs_state": _compare(mamba, reference, scan_inputs, grads, 1)}
    plain = {k: v[:, :48] if k not in ("A_H", "initial_state_BHPN") else v for k, v in scan_inputs.items()}
    plain.update(doc_ids_BS=None, initial_state_BHPN=None)
    report["scan_plain"] = _compare(mamba, reference, plain, grads[:5], 2)

    # the mixer's way: the scan between other ops in one compiled graph (fullgraph: a graph break is an error)
    # and its final state unused, as the mixer leaves it (no gradient flows into it)
    def block(**kw):
        y, _ = mamba(**{**kw, "x_BSHP": kw["x_BSHP"] * 2.0})
        return y.tanh()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    report["compiled_vs_eager"] = _compare(compiled, block, scan_inputs, grads, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    import sys

    main_mamba() if sys.argv[1:] == ["mamba"] else main()
