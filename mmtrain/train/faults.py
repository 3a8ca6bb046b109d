"""What a run does when something goes wrong: non-finite losses/gradients, and preemption (SIGTERM).

Every decision is taken on values all ranks agree on (reduced loss and global grad norm, an all-reduced
preemption flag), so the ranks never diverge: they all skip the same step, or all stop, or all save and exit.
"""

from __future__ import annotations

import math
import signal

import torch
import torch.distributed as dist

from mmtrain.parallel.dims import ParallelMesh


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names this rank, the step and what it was doing."""


def is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (dist.DistBackendError, RuntimeError)) and ("timed out" in text or "timeout" in text)


def collective_timeout_report(exc: BaseException, rank: int, step: int, phase: str, timeout_s: float) -> str:
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return (f"rank {rank}: a collective during {phase} of step {step} did not complete within {timeout_s:.0f}s "
            f"(parallel.collective_timeout_s). Backend says: {first}. Usually another rank died or is stuck: "
            "look for the first error in the other ranks' logs.")


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm; the message names the step and the ranks."""


def _ranks_with_nonfinite_loss(local_loss_sum: torch.Tensor, device: torch.device) -> list[int]:
    """Global ranks whose own (unreduced) loss sum is NaN/Inf."""
    bad = torch.tensor([0.0 if torch.isfinite(local_loss_sum).item() else 1.0], device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if bad.item() else []
    flags = [torch.zeros_like(bad) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, bad)
    return [r for r, f in enumerate(flags) if f.item()]


def nonfinite_report(step: int, loss: float, grad_norm: float, local_loss_sum: torch.Tensor,
                     device: torch.device) -> str | None:
    """None when loss and grad norm are finite, else one line naming the step and the ranks concerned."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    ranks = _ranks_with_nonfinite_loss(local_loss_sum, device)
    where = (f"non-finite loss on rank(s) {ranks}" if ranks
             else "losses finite on every rank: a gradient overflowed (see grad_norm)")
    return f"step {step}: loss {loss}, grad_norm {grad_norm} ({where})"


class PreemptionWatch:
    """Remembers a SIGTERM (the usual preemption notice) so the loop can save and exit cleanly."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread (e.g. some test runners): no handler, no preemption
            pass

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, mesh: ParallelMesh, device: torch.device) -> bool:
        """True on every rank as soon as any rank got the signal (an all-reduce of one number)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if mesh.dims.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
