"""The gradient-writing Triton kernel (``mmtrain.parallel.grad_accumulate``) is bit-identical to PyTorch's
``copy_`` / ``add_`` of a BF16 gradient into an fp32 buffer. Run by Triton's interpreter on the CPU (a child
process: the interpreter is chosen when Triton is imported); tests/gpu runs it on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import torch
from mmtrain.parallel.grad_accumulate import launch
g = torch.Generator().manual_seed(0)
for n in (1, 4095, 4096, 10_001):
    grad = torch.randn(n, generator=g).bfloat16()
    start = torch.randn(n, generator=g)
    copied, added = start.clone(), start.clone()
    launch(copied, grad, add=False)
    launch(added, grad, add=True)
    assert torch.equal(copied, grad.float()), n
    assert torch.equal(added, start + grad), n
print("ok")
"""


def test_kernel_equals_torch_copy_and_add_bit_for_bit():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_its_launches_compile_for_the_h200_with_16_byte_accesses():
    """``launch``'s own kernel calls, recorded on CPU tensors and compiled for sm_90 offline (tests/triton_sm90.py:
    no GPU) as a launch on a Llama's buffers specializes them: every load and store moves 16 bytes (the adding
    one loads the fp32 too)."""
    from mmtrain.parallel.grad_accumulate import launch
    from tests.triton_sm90 import captured_launches, compile_launch, global_memory_ops

    with captured_launches() as launches:
        for add in (False, True):
            launch(torch.zeros(8192), torch.zeros(8192, dtype=torch.bfloat16), add=add)
    loads = []
    for kernel, args, kwargs in launches:
        ops = global_memory_ops(compile_launch(kernel, args, kwargs).asm["ptx"])
        assert set(ops) == {"ld.global.v4.b32", "st.global.v4.b32"}, ops
        loads.append(ops["ld.global.v4.b32"])
    assert loads[1] == 3 * loads[0]  # 16 bytes of BF16 a thread, and then 32 of fp32
