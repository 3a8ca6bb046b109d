"""Cross-cutting features of a training step behind one small interface the loop calls at fixed points.

The loop knows the order of a step (forward/backward -> gradient reduction -> clip -> optimizer step -> logging
and checkpoint) and nothing of what rides on it: precision (FP8 scaling and weight casts, ``train/precision.py``),
MoE router-bias balancing and the preemption check are ``StepHooks``, built once per run.

No hook may read a device value on a step that is not a *sync point*: step metrics are handed back as device
tensors and converted to Python values by ``host_metrics`` at the loop's logging steps only (docs/user-guide.md,
"Host syncs").
"""

from __future__ import annotations

import torch

from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.expert import update_router_biases
from mmtrain.train.faults import PreemptionWatch


class StepHooks:
    """What a feature does at the step's fixed points; every method is a no-op here (override what is needed)."""

    def start(self) -> None:
        """Once before the first step, after a resume has loaded the state."""

    def after_backward(self, step: int) -> None:
        """After the step's last backward, before the gradients are reduced."""

    def after_optimizer_step(self, step: int) -> None:
        """After the optimizer step (also on a step whose update was skipped on the device: values unchanged)."""

    def step_metrics(self, step: int) -> dict:
        """This step's values for the metrics row, as device tensors (no host sync); ``host_metrics`` converts."""
        return {}

    def host_metrics(self, values: dict) -> dict:
        """``step_metrics``' values as the metrics row's Python values (called at logging steps only)."""
        return values

    def stop_requested(self, sync_point: bool) -> bool:
        """True when the run must save and stop after this step; the same answer on every rank. Only at a
        ``sync_point`` (a logging step) may the answer need a collective or a device read."""
        return False

    def close(self) -> None:
        """At the end of the run, also after an error."""


class RouterBiasBalancer(StepHooks):
    """MoE: after each step, sum every MoE layer's expert load over the ranks that saw different tokens (dp×cp,
    and tp under sequence parallelism) and nudge sigmoid routers' biases toward balance (``update_router_biases``);
    the loads are logged as ``moe_load`` and ``moe_max_load``."""

    def __init__(self, stage: torch.nn.Module, mesh: ParallelMesh, sequence_parallel: bool) -> None:
        self.stage = stage
        self.groups = [mesh.dp_cp_group, mesh.tp_group if sequence_parallel else None]
        self.loads: dict[str, torch.Tensor] = {}

    def after_optimizer_step(self, step: int) -> None:
        self.loads = update_router_biases(self.stage, self.groups)

    def step_metrics(self, step: int) -> dict:
        loads, self.loads = self.loads, {}
        return {"moe_load": loads} if loads else {}

    def host_metrics(self, values: dict) -> dict:
        if not values:
            return {}
        loads = {name: [int(v) for v in load.tolist()] for name, load in values["moe_load"].items()}
        per_layer = [max(v) * len(v) / max(sum(v), 1) for v in loads.values()]
        # busiest expert / mean expert, worst layer (1.0 = balanced)
        return {"moe_max_load": max(per_layer), "moe_load": loads}


class PreemptionCheck(StepHooks):
    """SIGTERM -> save and exit. The signal handler sets a host flag; one process reads it every step, several
    agree on it (an all-reduce and a read) at sync points only, i.e. within ``logging.log_every`` steps."""

    def __init__(self, mesh: ParallelMesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device
        self.watch = PreemptionWatch()

    def stop_requested(self, sync_point: bool) -> bool:
        if self.mesh.dims.world_size == 1:
            return self.watch.requested
        return self.watch.agreed(self.mesh, self.device) if sync_point else False

    def close(self) -> None:
        self.watch.close()
