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
    """Layer ranges per stage: even by default (extra layers to the middle stages' right, Megatron-style), or
    exactly ``layers_per_stage`` (uneven first/last stages, e.g. lighter stages holding the embedding/head)."""
    if layers_per_stage:
        if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
            raise ValueError(f"parallel.pipeline_layers {layers_per_stage} must have {pp} positive entries summing to "
                             f"model.num_layers ({num_layers})")
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
