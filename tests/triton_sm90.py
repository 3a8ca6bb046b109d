"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU, for tests that check what the GPU
would run: that a kernel compiles at all (the interpreter runs what compiled Triton may refuse), and what its
PTX does (e.g. 16-byte loads where alignment is promised). Triton's wheel brings its own ptxas; where it cannot
compile offline the test is skipped.

The arguments mirror a launch: pointer arguments are 16-byte aligned as Triton assumes for torch's allocations
(``tt.divisibility``), integer arguments named in ``divisible`` likewise (a launch specializes multiples of 16).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, divisible: tuple[str, ...] = (),
                 num_warps: int = 4):
    """The compiled kernel of ``fn`` (a ``triton.jit`` function) for sm_90: ``signature`` maps each runtime
    argument to its Triton type ("*fp32", "i32", ...), ``constexprs`` the compile-time ones."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = [name for name, kind in signature.items() if kind.startswith("*")] + list(divisible)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:  # no ptxas / CUDA backend in this Triton: nothing to check here
        if "ptxas" in str(e).lower() or "backend" in str(e).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {str(e).splitlines()[0][:120]}")
        raise


def global_memory_ops(ptx: str) -> Counter:
    """Each kind of global load and store in the PTX (``ld.global.v4.b32``: four 32-bit words, 16 bytes)."""
    return Counter(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx))
