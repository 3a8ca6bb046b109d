"""The Mamba-2 SSD chunked scan on the GPU through mamba-ssm's own Triton kernels (``mamba_ssm.ops.triton.
ssd_combined``, the kernels Mamba-2 was published with), behind ``ssd.py``'s signature: the scan that trains on
Hopper, where fla-core 0.6 refuses its backward (``ssd_triton.fla_backward_trusted``).

Read in mamba-ssm 2.3.2's source and checked against ``ssd.ssd_chunked_scan`` (tests/unit/test_ssd_mamba.py runs the
kernels under Triton's CPU interpreter; tests/gpu/test_ssd_mamba_gpu.py on the GPU):
  - layouts are this interface's: x (b, l, h, p), dt (b, l, h), A (h), B and C (b, l, g, n) with head h reading
    group h // (h / g), the states (b, h, p, n); the final state comes back fp32, y in x's dtype;
  - ``dt`` arrives softplus'ed, biased and clamped by the mixer, so none of ``dt_softplus``, ``dt_bias`` or
    ``dt_limit`` applies: the limit passed is (-inf, inf) (its default (0, inf) would clamp, and zero the gradient
    of, a negative dt the reference takes as it is); ``D`` and ``z`` stay with the mixer too (its D skip and gated
    norm);
  - packed documents are ``seq_idx`` (b, l) int32: a token reads the state entering its chunk, and a chunk's
    state is passed on, only where its ``seq_idx`` equals the one of the previous chunk's last token, and the
    ``C.B`` scores of two tokens of different documents are zeroed. That is the reference's reset. The state
    before the row (``initial_states``) counts as ``seq_idx`` 0 (forward and backward), so ``seq_idx`` here
    is the number of document starts before each token: the row's first document is 0 whatever its id, and the
    initial state continues it, as in the reference. Computed on the GPU (a cumulative sum): no host sync;
    ``initial_states`` and ``seq_idx`` combine in this version, so no call falls back to the reference;
  - the kernels' chunk length is the caller's ``chunk_size`` when it is a power of two from 16 to 256 (the block
    decomposition is exact: the chunk length changes rounding and speed only), else ``DEFAULT_CHUNK_SIZE``.

Under ``torch.compile`` (the model compiles its blocks) the scan is a ``torch.library.custom_op`` with a registered
autograd formula and shape functions: the compiled block stays one graph, forward and backward, with the kernels
as opaque calls. Dynamo cannot trace mamba-ssm's host code (autotuners with pre-hooks, ``best_config`` read after a
launch, device context managers), and ``torch._dynamo.disable`` would split the block's graph in two around it.
The backward calls mamba-ssm's own backward (``_mamba_chunk_scan_combined_bwd``, the function its autograd.Function
calls; private, hence the version checked above). The first call of each kernel autotunes (Triton compiles each
of its configs once: on the order of a minute per dtype and document mode; the compiled kernels stay in Triton's
disk cache for later processes).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types

import torch

from mmtrain.models.nemotron_h.ssd_triton import KERNEL_DTYPES, check_scan_inputs

# Nemotron-H's chunk length: the kernels' when the caller's is not a power of two from 16 to 256.
DEFAULT_CHUNK_SIZE = 128

INSTALL_HINT = (
    "pip install wheel; MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps "
    "mamba-ssm==2.3.2.post1")


def import_skipping_package_init(package: str, submodule: str) -> types.ModuleType:
    """``package.submodule`` imported without executing ``package/__init__.py``, or a one-line ImportError.

    Why: mamba-ssm's package ``__init__`` imports its CUDA extension (``selective_scan_cuda``), which a build with
    MAMBA_SKIP_CUDA_BUILD=TRUE (the Triton kernels only: no nvcc, no build against the installed torch) lacks,
    while ``ops.triton.ssd_combined`` needs only torch, triton, einops and packaging. So a bare module carrying the
    package's search path stands in for the package while the submodule imports, and is taken out again after
    (a later ``import mamba_ssm`` runs the real ``__init__``); the subpackages on the way (``ops``, ``ops.triton``,
    ``utils``) are imported normally. A package already imported is used as it is."""
    name = f"{package}.{submodule}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(package)  # locates the package without executing its __init__
    except (ImportError, ValueError) as err:
        spec, reason = None, f"{type(err).__name__}: {err}"
    else:
        reason = "it is not installed"
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} cannot be imported: {reason} ({INSTALL_HINT})")
    stand_in = None
    if package not in sys.modules:
        stand_in = types.ModuleType(package)
        stand_in.__path__ = list(spec.submodule_search_locations)
        stand_in.__spec__ = spec
        sys.modules[package] = stand_in
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or Triton failing to find its driver
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ImportError(f"importing {name} failed: {type(err).__name__}: {first_line} ({INSTALL_HINT})") from None
    finally:
        if stand_in is not None and sys.modules.get(package) is stand_in:
            del sys.modules[package]


@functools.cache
def _ssd_combined_or_reason() -> types.ModuleType | str:
    """mamba-ssm's ``ssd_combined`` module, or why it cannot be imported (one line); looked up once a process."""
    try:
        return import_skipping_package_init("mamba_ssm", "ops.triton.ssd_combined")
    except ImportError as err:
        return str(err)


def load_mamba_ssd() -> types.ModuleType:
    """mamba-ssm's ``ssd_combined`` module, or a one-line ImportError saying how to install it."""
    module = _ssd_combined_or_reason()
    if isinstance(module, str):
        raise ImportError(f"the GPU training scan needs mamba-ssm's Triton kernels: {module}")
    return module


@torch._dynamo.assume_constant_result
def mamba_ssd_available() -> bool:
    """Whether mamba-ssm's SSD kernels import here (a constant while compiling: the answer cannot change)."""
    return not isinstance(_ssd_combined_or_reason(), str)


def kernel_chunk_size(chunk_size: int) -> int:
    """The chunk length the kernels run (module docstring)."""
    power_of_two = chunk_size & (chunk_size - 1) == 0
    return chunk_size if power_of_two and 16 <= chunk_size <= 256 else DEFAULT_CHUNK_SIZE


def document_index(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """mamba-ssm's ``seq_idx`` (int32) of packed rows: the number of document starts before each token (0 for the
    row's first document, which an initial state continues)."""
    starts_BS = torch.zeros_like(doc_ids_BS, dtype=torch.int32)
    starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    return starts_BS.cumsum(1, dtype=torch.int32)


_NO_LIMIT = (float("-inf"), float("inf"))


@torch.library.custom_op("mmtrain::mamba_ssd_scan", mutates_args=())
def mamba_ssd_scan_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      chunk_size: int, seq_idx: torch.Tensor | None,
                      initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (b, l, h, p) in x's dtype, final state (b, h, p, n) fp32), both contiguous."""
    results = load_mamba_ssd()._mamba_chunk_scan_combined_fwd(
        x, dt, A, B, C, chunk_size, initial_states=initial_state, seq_idx=seq_idx, dt_limit=_NO_LIMIT)
    return results[0].contiguous(), results[5].contiguous()


@mamba_ssd_scan_op.register_fake
def _(x, dt, A, B, C, chunk_size, seq_idx, initial_state):
    batch, _, heads, head_dim = x.shape
    return (x.new_empty(x.shape),
            x.new_empty((batch, heads, head_dim, B.shape[-1]), dtype=torch.float32))


@torch.library.custom_op("mmtrain::mamba_ssd_scan_backward", mutates_args=())
def mamba_ssd_scan_backward_op(
        dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
        B: torch.Tensor, C: torch.Tensor, y: torch.Tensor, chunk_size: int, seq_idx: torch.Tensor | None,
        initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor, torch.Tensor]:
    """Gradients of x, dt, A, B, C (each in its input's dtype, contiguous) and of the initial state (fp32; empty
    when there is none)."""
    dx, ddt, dA, dB, dC, _dD, _dz, _ddt_bias, dinitial = load_mamba_ssd()._mamba_chunk_scan_combined_bwd(
        dy, x, dt, A, B, C, y, chunk_size, initial_states=initial_state, dfinal_states=dfinal, seq_idx=seq_idx,
        dt_limit=_NO_LIMIT)
    dinitial = dinitial.float().contiguous() if initial_state is not None else x.new_empty(0, dtype=torch.float32)
    return (dx.contiguous(), ddt.to(dt.dtype).contiguous(), dA.to(A.dtype).contiguous(), dB.contiguous(),
            dC.contiguous(), dinitial)


@mamba_ssd_scan_backward_op.register_fake
def _(dy, dfinal, x, dt, A, B, C, y, chunk_size, seq_idx, initial_state):
    dinitial = (initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
                else x.new_empty(0, dtype=torch.float32))
    return (x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
            C.new_empty(C.shape), dinitial)


def _save_for_backward(ctx, inputs, output) -> None:
    x, dt, A, B, C, chunk_size, seq_idx, initial_state = inputs
    # y is kept for mamba-ssm's backward, which takes it (its gated path reads it)
    ctx.save_for_backward(x, dt, A, B, C, output[0], seq_idx, initial_state)
    ctx.chunk_size = chunk_size


def _backward(ctx, dy, dfinal):
    x, dt, A, B, C, y, seq_idx, initial_state = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(y)
    dx, ddt, dA, dB, dC, dinitial = mamba_ssd_scan_backward_op(
        dy.to(y.dtype), dfinal, x, dt, A, B, C, y, ctx.chunk_size, seq_idx, initial_state)
    return dx, ddt, dA, dB, dC, None, None, (dinitial if initial_state is not None else None)


mamba_ssd_scan_op.register_autograd(_backward, setup_context=_save_for_backward)


def mamba_scan(x_BSHP: torch.Tensor, dt_BSH: torch.Tensor, A_H: torch.Tensor, B_BSGN: torch.Tensor,
               C_BSGN: torch.Tensor, chunk_size: int, doc_ids_BS: torch.Tensor | None,
               initial_state_BHPN: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan as one mamba-ssm call (checked inputs; any device the kernels run on): B and C in x's dtype
    (the kernels' dots take one dtype), dt, A and the initial state in fp32."""
    dtype = x_BSHP.dtype
    seq_idx = document_index(doc_ids_BS) if doc_ids_BS is not None else None
    initial = initial_state_BHPN.float() if initial_state_BHPN is not None else None
    return mamba_ssd_scan_op(x_BSHP, dt_BSH.float(), A_H.float(), B_BSGN.to(dtype), C_BSGN.to(dtype),
                             kernel_chunk_size(chunk_size), seq_idx, initial)


def ssd_chunked_scan_mamba(
    x_BSHP: torch.Tensor,
    dt_BSH: torch.Tensor,
    A_H: torch.Tensor,
    B_BSGN: torch.Tensor,
    C_BSGN: torch.Tensor,
    chunk_size: int,
    doc_ids_BS: torch.Tensor | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan on CUDA tensors through mamba-ssm's Triton kernels; same signature and result as
    ``mmtrain.models.nemotron_h.ssd.ssd_chunked_scan`` up to rounding. Returns ``(y_BSHP in x's dtype,
    final_state_BHPN in fp32)``."""
    check_scan_inputs(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size, doc_ids_BS, initial_state_BHPN)
    if x_BSHP.device.type != "cuda" or x_BSHP.dtype not in KERNEL_DTYPES:
        raise ValueError(f"ssd_chunked_scan_mamba runs on CUDA tensors in fp32, bf16 or fp16, got x in "
                         f"{x_BSHP.dtype} on {x_BSHP.device}; use ssd.ssd_chunked_scan (the PyTorch reference)")
    return mamba_scan(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size, doc_ids_BS, initial_state_BHPN)
