"""Training precision as a layer of the step: what BF16/FP32 (nothing) and FP8 do at the loop's fixed points.

``precision_for(stage, cfg, mesh)`` is the only place the trainer looks at FP8: it returns a ``Precision``
(``StepHooks`` plus the two set-up calls the gradient buckets need), and the loop calls it without knowing
which one it has. FP8 (``stage.fp8_runtime``, set by ``train/build.py``): delayed-scaling amaxes after backward,
the FP8 weight copies marked stale after the optimizer step, and with ``fp8.param_gather`` the FP8 weights in
buckets of their own that are all-gathered in FP8 (docs/fp8.md); with ``parallel.fsdp`` each block's FP8 weights
are gathered in FP8 for each use (``mmtrain.model.fp8_fsdp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.train.step_hooks import StepHooks
from mmtrain.utils.log import get_logger

if TYPE_CHECKING:  # the FP8 modules load only for FP8 runs: they import torch._dynamo (~1 s per process)
    from mmtrain.model.fp8 import Fp8Runtime


class Precision(StepHooks):
    """BF16 / FP32 weights: nothing to do at any point."""

    def bucket_options(self) -> dict:
        """Extra keyword arguments of the dense parameters' ``GradBuckets`` (e.g. weights in buckets of their own)."""
        return {}

    def attach(self, dense_buckets: GradBuckets) -> None:
        """Called once the dense parameters' buckets exist (before the optimizer)."""

    def fsdp_options(self, unit_params: set[int]) -> dict:
        """Extra keyword arguments of the dense parameters' ``FsdpBuckets`` (``parallel.fsdp``; ``unit_params``:
        ids of the parameters in its units)."""
        return {}

    def attach_fsdp(self, dense_buckets) -> None:
        """Called once the dense parameters' ``FsdpBuckets`` exist (before the optimizer)."""


class Fp8Precision(Precision):
    """FP8 linears (native or Transformer Engine) and, with ``fp8.param_gather``, the FP8 parameter gather."""

    def __init__(self, runtime: Fp8Runtime, cfg, mesh: ParallelMesh) -> None:
        self.runtime, self.mesh = runtime, mesh
        from mmtrain.model import fp8_param_gather

        self.gathered = fp8_param_gather.gather_weights(runtime, cfg, mesh.size("dp_cp"))
        self.fsdp_gathered: list = []  # parallel.fsdp: set by fsdp_options

    def bucket_options(self) -> dict:
        return {"separate_params": self.gathered}

    def attach(self, dense_buckets: GradBuckets) -> None:
        if self.gathered:  # attaches itself to the buckets (gathers) and the runtime (no re-cast from partial BF16)
            from mmtrain.model import fp8_param_gather

            fp8_param_gather.Fp8ParamGather(dense_buckets, self.runtime, self.mesh.tp_group)

    def fsdp_options(self, unit_params: set[int]) -> dict:
        # FSDP frees the blocks' BF16 weights between uses: their FP8 copies always come from an FP8 gather
        from mmtrain.model import fp8_fsdp

        self.fsdp_gathered = fp8_fsdp.fsdp_gather_weights(self.runtime, unit_params)
        return {"separate_params": self.fsdp_gathered}

    def attach_fsdp(self, dense_buckets) -> None:
        if self.fsdp_gathered:
            from mmtrain.model import fp8_fsdp

            fp8_fsdp.Fp8FsdpGather(dense_buckets, self.runtime, self.mesh.tp_group)

    def start(self) -> None:
        get_logger("train").info(self.runtime.describe())
        self.runtime.weights_changed()  # from here on the loop says when the FP8 weight copies are stale

    def after_backward(self, step: int) -> None:
        # delayed scaling: the step's amaxes, one scale for each tensor over tp x dp x cp
        self.runtime.after_backward([self.mesh.tp_group, self.mesh.dp_cp_group])

    def after_optimizer_step(self, step: int) -> None:
        self.runtime.weights_changed()


def precision_for(stage: nn.Module, cfg, mesh: ParallelMesh) -> Precision:
    """The precision layer of a built stage: FP8 when ``build`` gave it an ``fp8_runtime``, else plain."""
    runtime = getattr(stage, "fp8_runtime", None)
    return Fp8Precision(runtime, cfg, mesh) if runtime is not None else Precision()
