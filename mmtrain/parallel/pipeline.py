"""Pipeline parallelism: which layers each stage holds, and the 1F1B schedule over micro-batches.

The schedule is Megatron's non-interleaved 1F1B: stage ``s`` of ``p`` runs ``min(p - s - 1, m)`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining backwards. So at most
``p - s`` micro-batches' activations are alive on a stage, whatever the number of micro-batches ``m``.
Activations travel with batched isend/irecv over the ``pp`` group; shapes are static (no shape exchange).

A stage's forward returns the *sum* of its micro-batch's token losses on the last stage (the trainer divides
gradients by the global token count afterwards, which keeps every layout exactly equal to one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


def stage_layer_ranges(num_layers: int, pp: int, layers_per_stage: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges per (virtual) stage: even by default (extra layers to the later stages), or exactly
    ``layers_per_stage`` (uneven first/last stages, e.g. lighter stages holding the embedding/head)."""
    if layers_per_stage:
        if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
            raise ValueError(f"parallel.pipeline_layers {layers_per_stage} must have {pp} positive entries (one per "
                             f"stage, pp * virtual_pp) summing to model.num_layers ({num_layers})")
        counts = layers_per_stage
    else:
        base, extra = divmod(num_layers, pp)
        counts = [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


@dataclass
class PipelineComm:
    """Point-to-point exchange with the neighbouring stages of this rank's pipeline."""

    group: object
    prev_rank: int | None  # global ranks; None at the ends
    next_rank: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def _exchange(self, send_prev=None, send_next=None, recv_prev=False, recv_next=False):
        ops, got_prev, got_next = [], None, None
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev_rank, self.group))
        if recv_prev:
            got_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_prev, self.prev_rank, self.group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next_rank, self.group))
        if recv_next:
            got_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_next, self.next_rank, self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return got_prev, got_next

    def recv_forward(self):
        return None if self.prev_rank is None else self._exchange(recv_prev=True)[0].requires_grad_()

    def send_forward(self, out):
        if self.next_rank is not None:
            self._exchange(send_next=out.detach())

    def recv_backward(self):
        return None if self.next_rank is None else self._exchange(recv_next=True)[1]

    def send_backward(self, grad):
        if self.prev_rank is not None:
            self._exchange(send_prev=grad)

    def send_forward_recv_backward(self, out):
        if self.next_rank is None:
            return None
        return self._exchange(send_next=out.detach(), recv_next=True)[1]

    def send_backward_recv_forward(self, grad):
        if self.prev_rank is None:
            return None
        return self._exchange(send_prev=grad, recv_prev=True)[0].requires_grad_()


def _backward(inp, out, grad_out):
    if grad_out is None:  # last stage: `out` is the summed loss
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad_out)
    return inp.grad if inp is not None else None


def one_f_one_b(forward_step: Callable[[int, torch.Tensor | None], torch.Tensor], num_micro: int,
                comm: PipelineComm, stage: int, num_stages: int,
                before_last_backward: Callable[[], None] = lambda: None) -> None:
    """Run forward_step(i, received_input) for every micro-batch i with its backward, in 1F1B order.
    ``before_last_backward`` runs right before the last micro-batch's backward (gradient reduction may start)."""
    backwards_left = num_micro

    def backward(inp, out, grad_out):
        nonlocal backwards_left
        backwards_left -= 1
        if backwards_left == 0:
            before_last_backward()
        return _backward(inp, out, grad_out)

    warmup = min(num_stages - stage - 1, num_micro)
    remaining = num_micro - warmup
    inputs, outputs = [], []
    for i in range(warmup):
        x = comm.recv_forward()
        out = forward_step(i, x)
        comm.send_forward(out)
        inputs.append(x)
        outputs.append(out)
    x = comm.recv_forward() if remaining else None
    for i in range(remaining):
        out = forward_step(warmup + i, x)
        grad_out = comm.send_forward_recv_backward(out)
        inputs.append(x)
        outputs.append(out)
        grad_in = backward(inputs.pop(0), outputs.pop(0), grad_out)
        if i == remaining - 1:
            comm.send_backward(grad_in)
        else:
            x = comm.send_backward_recv_forward(grad_in)
    for _ in range(warmup):
        grad_out = comm.recv_backward()
        grad_in = backward(inputs.pop(0), outputs.pop(0), grad_out)
        comm.send_backward(grad_in)


def forward_only(forward_step: Callable[[int, torch.Tensor | None], torch.Tensor], num_micro: int,
                 comm: PipelineComm) -> None:
    """Evaluation: each micro-batch flows through the stages; no backward, nothing kept."""
    for i in range(num_micro):
        x = comm.recv_forward()
        out = forward_step(i, None if x is None else x.detach())
        comm.send_forward(out)


def interleaved_schedule(forward_step: Callable[[int, int, torch.Tensor | None], torch.Tensor], num_micro: int,
                         group, ranks: list[int], stage: int, num_chunks: int, shape: tuple[int, ...],
                         dtype: torch.dtype, device: torch.device, backward: bool = True,
                         before_last_backward: Callable[[], None] = lambda: None) -> None:
    """Interleaved virtual stages: rank ``stage`` runs chunks c = 0..v-1 = virtual stages ``c * p + stage``.

    Order (Megatron's): micro-batches in groups of p; within a group all of chunk 0, then chunk 1, ... Every
    forward runs before the backwards, which run in reverse order (all micro-batches' activations stay alive:
    the memory of GPipe, a bubble v times smaller than plain 1F1B's). Sends are asynchronous and only receives
    block; each rank's order is consistent with one global order, so no cycle of waits can form.
    ``forward_step(chunk, micro_batch, received)`` returns the chunk's output (the summed loss on the last).
    """
    p, v = len(ranks), num_chunks
    if num_micro % p:
        raise ValueError(f"interleaved pipelining needs the micro-batches per step ({num_micro}) to be a multiple of "
                         f"parallel.pp ({p})")
    last_vs = p * v - 1
    prev_rank, next_rank = ranks[(stage - 1) % p], ranks[(stage + 1) % p]
    order = [(c, mb) for g in range(num_micro // p) for c in range(v) for mb in range(g * p, (g + 1) * p)]
    sends, saved = [], []

    def recv(src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buf, src, group=group, tag=tag).wait()
        return buf

    for c, mb in order:
        vs = c * p + stage
        x = None if vs == 0 else recv(prev_rank, 0).requires_grad_(backward)
        out = forward_step(c, mb, x)
        if vs != last_vs:
            keep = out.detach().contiguous()
            sends.append((keep, dist.isend(keep, next_rank, group=group, tag=0)))
        if backward:
            saved.append((vs, x, out))
    if backward:
        for i, (vs, x, out) in enumerate(reversed(saved)):
            grad = None if vs == last_vs else recv(next_rank, 1)
            if i == len(saved) - 1:
                before_last_backward()
            _backward(x, out, grad)
            if vs != 0:
                g = x.grad.contiguous()
                sends.append((g, dist.isend(g, prev_rank, group=group, tag=1)))
    for _, handle in sends:
        handle.wait()
