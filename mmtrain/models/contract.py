"""The family contract: what the shared code (build, compile, recompute, ...) may use of a model family's stage
model and its blocks. Plain Python (no torch): ``mmtrain.parallel`` may import this module, never a model.

``FamilyStage`` (what a family's ``build_stage`` returns): ``compile_head()`` compiles what of the output
head's loss path is worth compiling on one TP rank (the family decides); nothing on a stage without a head.

``FamilyBlock`` (each value of a stage's ``layers``): ``compile_parts(scope)`` ``torch.compile``s what of the
block may be compiled under ``scope``, one of ``COMPILE_SCOPES``: ``block`` (nothing outside needs the block's
call eager), ``inside_call`` (hooks sit on the block's call, e.g. FSDP's gather/free: compile only what runs
inside it), ``no_linears`` (the linears run kernels dynamo does not trace, e.g. Transformer Engine: compile
only the rest). The block narrows it further where it must (an MoE block compiles its dense parts only: token
counts per expert are data-dependent).
"""

from __future__ import annotations

from typing import Protocol

COMPILE_SCOPES = ("block", "inside_call", "no_linears")


class FamilyBlock(Protocol):
    """One block of a stage's ``layers`` (see the module docstring)."""

    def compile_parts(self, scope: str) -> None: ...


class FamilyStage(Protocol):
    """What a family's ``build_stage`` returns (see the module docstring)."""

    def compile_head(self) -> None: ...


def check_compile_scope(scope: str) -> None:
    """A one-line error for a compile scope outside ``COMPILE_SCOPES``."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}; expected one of {', '.join(COMPILE_SCOPES)}")
