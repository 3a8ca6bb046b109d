"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU, for tests that check what the GPU
would run: that a kernel compiles at all (the interpreter runs what compiled Triton may refuse), and what its
PTX does (e.g. 16-byte loads where alignment is promised). Triton's wheel brings its own ptxas; where it cannot
compile offline the test is skipped.

The arguments mirror a launch: pointer arguments are 16-byte aligned as Triton assumes for torch's allocations
(``tt.divisibility``), integer arguments named in ``divisible`` likewise (a launch specializes multiples of 16).
``captured_launches`` records the launches the product's own host code makes (run on CPU tensors of the real
shapes, nothing executed) and ``compile_launch`` compiles each as a GPU launch of those arguments would.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter

import pytest
import torch

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
                torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, divisible: tuple[str, ...] = (),
                 num_warps: int = 4, **options):
    """The compiled kernel of ``fn`` (a ``triton.jit`` function) for sm_90: ``signature`` maps each runtime
    argument to its Triton type ("*fp32", "i32", ...), ``constexprs`` the compile-time ones; ``options``: more
    of Triton's compile options (``num_stages``, ``num_ctas``, ...)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = [name for name, kind in signature.items() if kind.startswith("*")] + list(divisible)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    except RuntimeError as e:  # no ptxas / CUDA backend in this Triton: nothing to check here
        if "ptxas" in str(e).lower() or "backend" in str(e).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {str(e).splitlines()[0][:120]}")
        raise


def global_memory_ops(ptx: str) -> Counter:
    """Each kind of global load and store in the PTX (``ld.global.v4.b32``: four 32-bit words, 16 bytes)."""
    return Counter(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx))


@contextlib.contextmanager
def captured_launches():
    """Within: every ``triton.jit`` kernel launch is recorded as (kernel, positional args, keyword args) in the
    yielded list instead of running (the host code around it runs on CPU tensors as it would on CUDA ones)."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def compile_launch(kernel, args: tuple, kwargs: dict):
    """``compile_sm90`` of one recorded launch: tensors as aligned pointers of their dtype, ints of 1 as
    constants and multiples of 16 as divisible (Triton's specializations), constexprs by the kernel's own marks,
    the launch's other keywords (``num_warps``, ``num_stages``, ``num_ctas``, ...) as compile options."""
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    constexpr_names = {kernel.arg_names[i] for i in kernel.constexprs}
    signature, constexprs, divisible = {}, {}, []
    for name in kernel.arg_names:
        value = values[name]
        if name in constexpr_names or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    return compile_sm90(kernel, signature, constexprs, tuple(divisible), **options)
