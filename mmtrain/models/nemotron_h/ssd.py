"""The Mamba-2 state-space recurrence (SSD), in plain PyTorch: the CPU reference, and ``ssd_scan``, what the mixer
calls (CUDA tensors to Triton kernels: mamba-ssm's, ``ssd_mamba.py``, or fla-core's, ``ssd_triton.py``; the rest to
the reference; ``scan_backend`` says which).

Per head ``h`` (of ``H``, in ``G`` groups: head h reads group ``h // (H // G)`` of B and C) and token ``t``::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T        (P x N: head dim x state size)
    y_t     = state_t C_t

``dt`` arrives softplus'ed, biased and clamped (the mixer's business, as are the D skip and the z gate). The scan is
computed chunk by chunk as the Mamba-2 paper's block decomposition of the sequence's (lower-triangular) mixing
matrix: inside a chunk of ``chunk_size`` tokens the diagonal block is an attention-like product masked by the
decays; across chunks each chunk's contribution is folded into a state of P x N per head, passed on by a short
recurrence over the chunks and read out by C.

Packed documents (``doc_ids_BS``: equal ids = one document, non-decreasing along a row) reset the state to zero
where a document starts, as mamba-ssm's kernels do with ``seq_idx``: every decay between two tokens of different
documents is zero, so a packed row computes what its documents would compute one by one. An ``initial_state``
continues a previous scan (decoding a prompt in pieces); it belongs to the row's first document.

All math is fp32 (fp64 for fp64 inputs: ``at_least_fp32``); ``y`` comes back in ``x``'s dtype, the final state
in the math's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmtrain.models.nemotron_h.ssd_mamba import mamba_ssd_available, ssd_chunked_scan_mamba
from mmtrain.models.nemotron_h.ssd_triton import KERNEL_DTYPES, fla_backward_trusted, ssd_chunked_scan_triton


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is when wider (fp64: the tests' exact comparisons)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``a`` (..., T) -> (..., T, T): entry [t, s] is the sum of ``a`` over (s, t] for t >= s, -inf above the
    diagonal. Sums of masked copies rather than differences of one cumulative sum: a difference of two large
    cumulative sums loses the small decays that matter."""
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    terms = a.unsqueeze(-1).expand(*a.shape, T).masked_fill(~ones.tril(-1), 0.0)  # [u, s] = a_u for u > s
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def _check_shapes(x, dt, A, B, C, doc_ids, initial_state) -> None:
    batch, seq, heads, _ = x.shape
    groups = B.shape[2]
    if dt.shape != (batch, seq, heads) or A.shape != (heads,) or B.shape[:2] != (batch, seq) or C.shape != B.shape:
        raise ValueError(f"ssd scan: shapes x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B "
                         f"{tuple(B.shape)}, C {tuple(C.shape)} do not agree (x BSHP, dt BSH, A H, B/C BSGN)")
    if heads % groups:
        raise ValueError(f"ssd scan: {heads} heads cannot share {groups} groups of B/C evenly")
    if doc_ids is not None and doc_ids.shape != (batch, seq):
        raise ValueError(f"ssd scan: doc_ids {tuple(doc_ids.shape)}; expected ({batch}, {seq})")
    if initial_state is not None and initial_state.shape != (batch, heads, x.shape[3], B.shape[3]):
        raise ValueError(f"ssd scan: initial_state {tuple(initial_state.shape)}; expected "
                         f"({batch}, {heads}, {x.shape[3]}, {B.shape[3]})")


def ssd_chunked_scan(x_BSHP: torch.Tensor, dt_BSH: torch.Tensor, A_H: torch.Tensor, B_BSGN: torch.Tensor,
                     C_BSGN: torch.Tensor, chunk_size: int, doc_ids_BS: torch.Tensor | None = None,
                     initial_state_BHPN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of the module docstring over whole sequences: ``(y_BSHP, final_state_BHPN)``; the final state is
    the one after the last token (it holds the last document only)."""
    _check_shapes(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, doc_ids_BS, initial_state_BHPN)
    batch, seq, heads, P = x_BSHP.shape
    G, N = B_BSGN.shape[2:]
    R, L = heads // G, chunk_size  # heads per group, tokens per chunk
    pad = -seq % L
    n = (seq + pad) // L

    # padding tokens have dt = 0: no decay, no input, so the state after them is the state after the last token
    def chunked(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(at_least_fp32(t), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, n, L, *t.shape[2:])

    x, dt, Bm, Cm = chunked(x_BSHP), chunked(dt_BSH), chunked(B_BSGN), chunked(C_BSGN)
    x = (x * dt[..., None]).view(batch, n, L, G, R, P)  # dt_t x_t: the input each token writes
    a = (dt * at_least_fp32(A_H)).permute(0, 3, 1, 2)  # (b, h, c, l): log-decay of each token
    a_cum = a.cumsum(-1)

    if doc_ids_BS is not None:
        ids = torch.cat([doc_ids_BS, doc_ids_BS[:, -1:].expand(batch, pad)], dim=1)  # padding: the last document's
        ids = ids.reshape(batch, n, L)
        # the document each chunk's incoming state belongs to: the previous chunk's last token's (the first
        # chunk's: the row's first document, which an initial state continues)
        ends = torch.cat([ids[:, :1, 0], ids[:, :, -1]], dim=1)  # (b, c + 1)

    # 1. inside each chunk: y_t += sum_{s <= t} (C_t . B_s) exp(a_{s+1} + ... + a_t) dt_s x_s
    log_decay = _segment_sums(a)  # (b, h, c, l, s)
    if doc_ids_BS is not None:
        log_decay = log_decay.masked_fill((ids[..., :, None] != ids[..., None, :])[:, None], float("-inf"))
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cm, Bm)  # one C.B product per group, shared by its heads
    weights = scores[:, :, None] * log_decay.exp().view(batch, G, R, n, L, L)
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", weights, x)

    # 2. each chunk's own contribution to the state at its end
    to_end = (a_cum[..., -1:] - a_cum).exp()  # (b, h, c, l): decay from token l to the chunk's end
    if doc_ids_BS is not None:
        to_end = to_end * (ids == ids[..., -1:])[:, None]
    chunk_states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bm, to_end.view(batch, G, R, n, L), x)

    # 3. the states entering each chunk: a recurrence over the chunks (and the initial state before the first)
    start = (initial_state_BHPN.to(x.dtype).view(batch, 1, G, R, P, N) if initial_state_BHPN is not None
             else chunk_states.new_zeros(batch, 1, G, R, P, N))
    states = torch.cat([start, chunk_states], dim=1)  # (b, c + 1, g, r, p, n)
    chunk_log_decay = _segment_sums(F.pad(a_cum[..., -1], (1, 0)))  # (b, h, c + 1, c + 1)
    if doc_ids_BS is not None:
        chunk_log_decay = chunk_log_decay.masked_fill((ends[:, :, None] != ends[:, None, :])[:, None], float("-inf"))
    carried = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_log_decay.exp().view(batch, G, R, n + 1, n + 1), states)
    entering, final = carried[:, :-1], carried[:, -1]

    # 4. the entering state read out at every token of the chunk, decayed to it
    from_start = a_cum.exp()  # (b, h, c, l)
    if doc_ids_BS is not None:
        from_start = from_start * (ids == ends[:, :-1, None])[:, None]
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cm, entering, from_start.view(batch, G, R, n, L))

    y = y.reshape(batch, n * L, heads, P)[:, :seq]
    return y.to(x_BSHP.dtype), final.reshape(batch, heads, P, N)


def ssd_step(state_BHPN: torch.Tensor, x_BHP: torch.Tensor, dt_BH: torch.Tensor, A_H: torch.Tensor,
             B_BGN: torch.Tensor, C_BGN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence (decoding): ``(y_BHP, new_state_BHPN)``; y in ``x``'s dtype, the state in
    ``state``'s."""
    heads, groups = x_BHP.shape[1], B_BGN.shape[1]
    dt = at_least_fp32(dt_BH)
    Bh = at_least_fp32(B_BGN).repeat_interleave(heads // groups, dim=1)  # (b, h, n)
    Ch = at_least_fp32(C_BGN).repeat_interleave(heads // groups, dim=1)
    decay = (dt * at_least_fp32(A_H)).exp()[..., None, None]
    written = (dt[..., None] * at_least_fp32(x_BHP))[..., None] * Bh[:, :, None, :]  # dt x B^T
    new_state = at_least_fp32(state_BHPN) * decay + written
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    return y.to(x_BHP.dtype), new_state.to(state_BHPN.dtype)


def scan_backend(x_BSHP: torch.Tensor, needs_grad: bool) -> str:
    """Which scan ``ssd_scan`` runs: "mamba" (mamba-ssm's kernels), "fla" (fla-core's) or "reference" (PyTorch).

    CUDA tensors in fp32, bf16 or fp16 take a kernel, anything else (the CPU, fp64) the reference. Without
    gradients (decoding, evaluation) fla: its forward is trusted everywhere, and serving keeps the kernels it was
    measured with. With gradients mamba-ssm when it is installed (``ssd_mamba.mamba_ssd_available``), else fla
    where its backward is trusted (``fla_backward_trusted``: not on Hopper with torch 2.11's Triton), else the
    reference (compiled with the block; at long sequences it saves several (chunks x chunk x chunk) fp32 tensors
    per head and layer). Both availability checks are constants while compiling."""
    if not x_BSHP.is_cuda or x_BSHP.dtype not in KERNEL_DTYPES:
        return "reference"
    if not needs_grad:
        return "fla"
    if mamba_ssd_available():
        return "mamba"
    return "fla" if fla_backward_trusted() else "reference"


def ssd_scan(x_BSHP: torch.Tensor, dt_BSH: torch.Tensor, A_H: torch.Tensor, B_BSGN: torch.Tensor,
             C_BSGN: torch.Tensor, chunk_size: int, doc_ids_BS: torch.Tensor | None = None,
             initial_state_BHPN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan the mixer calls (``ssd_chunked_scan``'s signature and results, up to rounding, no host sync) on the
    backend ``scan_backend`` picks."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, initial_state_BHPN) if t is not None)
    scan = {"mamba": ssd_chunked_scan_mamba, "fla": ssd_chunked_scan_triton,
            "reference": ssd_chunked_scan}[scan_backend(x_BSHP, needs_grad)]
    return scan(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size, doc_ids_BS, initial_state_BHPN)
