"""A training step's numbers on their way to the host, and its duration, without making the host wait.

The loop reads a step's loss, grad norm and stats back only at sync points (``mmtrain.train.loop``). A plain
``.tolist()`` there would be queued behind everything launched so far, so reading the step *before* the newest one
would still wait for the newest one: the device would run dry at every read. Instead each step's numbers are copied
to pinned host memory as the step's last work on the stream, with an event after the copy: a read waits for that
event only, and the steps queued after it keep the device busy.

A step's duration is measured on the device's own timeline (CUDA events; host clocks on the CPU, where a step's
work is done when its call returns): from the end of the step before it to its own end, so host work inside the
step (a GRPO step's generation, a slow data read) and between steps counts. After a step that evaluated, saved or
ran a hook's host work (samples), the next step's time starts at its own start instead: that work is not a step's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class PendingStep:
    """A step run but not yet read back."""

    step: int
    lr: float
    local_loss: torch.Tensor  # this rank's own loss sum (for the report naming the ranks of a non-finite loss)
    values: torch.Tensor  # [loss / tokens, grad norm, finite, *stats]: pinned host memory once ``ready`` fired
    ready: torch.cuda.Event | None  # recorded after the copy to ``values`` (None on the CPU: already there)
    began: object  # the clock mark this step's duration starts from
    ended: object  # the clock mark of this step's end
    hook_metrics: list[dict]

    def read(self) -> tuple[list[float], torch.Tensor]:
        """(loss, grad norm, finite), then the stats: waits for this step's copy only."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist()
        return values[:3], torch.tensor(values[3:], dtype=torch.float64)


class StepClock:
    """Marks on the device's timeline (CUDA events) or the host's (the CPU), and the seconds between two."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last_end: object | None = None  # the previous step's end, None after a pause

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> object:
        """A mark at a step's start; its duration starts at the previous step's end unless the clock paused."""
        return self.mark() if self.last_end is None else self.last_end

    def end(self) -> object:
        self.last_end = self.mark()
        return self.last_end

    def pause(self) -> None:
        """What runs until the next step's start (evaluation, a save) is not counted in any step."""
        self.last_end = None

    def seconds(self, began: object, ended: object) -> float:
        """Seconds from ``began`` to ``ended`` (both complete: the caller has read the later step back)."""
        if self.cuda:
            return began.elapsed_time(ended) / 1000.0
        return ended - began


def queue_readout(loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor,
                  stats: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a step's numbers to the host: ``(values, ready)`` for ``PendingStep``."""
    values = torch.cat([torch.stack([loss.double(), grad_norm.double(), finite.double()]), stats.double()])
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
