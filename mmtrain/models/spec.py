"""The sharding spec: for every tensor of a model, how parallelism places it and reduces its gradient.

A model family builds one ``ShardingSpec`` from its config (``mmtrain.models.<family>.spec``); a built model
returns it from ``model.sharding_spec()``. The shared machinery reads only this: the TP plan
(``mmtrain.parallel.tensor``: which linears become column/row-parallel, fused part sizes), checkpoint boxes and
resharding (``mmtrain.parallel.global_chunks``), the HF bridge's TP split/merge (``mmtrain.convert``) and
gradient finalisation (``mmtrain.train.grads``: TP partial sums, expert reduction group, tied copies). Nothing
there matches parameter names or reads parameter attributes, so a new family plugs in by writing its spec.

Plain data (no torch): ``mmtrain.parallel`` may import this module, never a model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

TP_PLACEMENTS = ("column", "row", "vocab", "replicated")
PARTIAL_GRAD = ("never", "always", "sequence_parallel")
REDUCE_GROUPS = ("dp_cp", "edp")
TP_INPUTS = ("auto", "copy", "local")


@dataclass(frozen=True)
class ParamSpec:
    """How one tensor (parameter or persistent buffer) is placed.

    ``tp``: ``column`` = output rows split over TP (a linear's weight and bias, dim 0), ``row`` = input columns
    split (dim 1; the bias stays whole), ``vocab`` = rows split by vocabulary (embedding, output layer),
    ``replicated`` = every TP rank holds it whole. ``dim``: the split dim (default 0, 1 for ``row``).
    ``parts``: sizes of fused blocks along ``dim`` ([q | k | v], [gate | up]); each part is split evenly on its
    own, so rank r holds the r-th slice of every part. ``()`` = one block. ``unit``: a split must not cut a block
    of this many rows (a head's ``head_dim``): every part is a multiple of ``unit * tp``.
    ``expert_dim``: the dim sliced over EP (experts ``[ep_rank * E/ep, ...)``). ``grad_reduce_group``: the data-
    parallel group the gradient is reduced over (``dp_cp`` dense, ``edp`` expert). ``tp_partial_grad``: a
    TP-replicated tensor whose gradient each TP rank holds only part of, summed over TP: ``never``, ``always``
    (e.g. per-head QK-norm weights), ``sequence_parallel`` (each TP rank saw only its slice of the sequence).
    ``tied_to``: a copy of another tensor (a tied embedding's copy on the last pipeline stage): stored under that
    name, its gradient summed with it. ``buffer``: not a parameter (no gradient). ``tp_input``: how a linear's
    input enters the TP region (copied over TP, or gathered along the sequence under SP; in backward its gradient
    is summed): ``auto`` = column linears copy their input, the others do not; ``copy`` = a replicated linear
    that opens the region for the column linears after it (MLA's ``q_down``/``kv_down``: their outputs feed
    per-head ``q_up``/``kv_up``, so their gradients are partial over TP); ``local`` = a column linear whose
    input is already in the region (``q_up``/``kv_up``: not copied again). ``adapter``: a LoRA (or DoRA) adapter tensor
    (trained while the base is frozen; not in a base checkpoint, so loading base weights leaves it as
    initialized; exported on its own as a ``peft`` adapter)."""

    tp: str = "replicated"
    dim: int | None = None
    parts: tuple[int, ...] = ()
    unit: int = 1
    expert_dim: int | None = None
    grad_reduce_group: str = "dp_cp"
    tp_partial_grad: str = "never"
    tied_to: str | None = None
    buffer: bool = False
    tp_input: str = "auto"
    adapter: bool = False

    def __post_init__(self) -> None:
        if self.tp not in TP_PLACEMENTS:
            raise ValueError(f"ParamSpec.tp={self.tp!r}; expected one of {', '.join(TP_PLACEMENTS)}")
        if self.tp_partial_grad not in PARTIAL_GRAD:
            raise ValueError(f"ParamSpec.tp_partial_grad={self.tp_partial_grad!r}; expected one of "
                             f"{', '.join(PARTIAL_GRAD)}")
        if self.grad_reduce_group not in REDUCE_GROUPS:
            raise ValueError(f"ParamSpec.grad_reduce_group={self.grad_reduce_group!r}; expected one of "
                             f"{', '.join(REDUCE_GROUPS)}")
        if self.tp_input not in TP_INPUTS or (self.tp_input == "copy" and self.tp != "replicated") or (
                self.tp_input == "local" and self.tp != "column"):
            raise ValueError(f"ParamSpec.tp_input={self.tp_input!r} with tp={self.tp!r}; expected auto, copy "
                             "(replicated) or local (column)")
        if self.dim is None and self.tp != "replicated":
            object.__setattr__(self, "dim", 1 if self.tp == "row" else 0)

    @property
    def tp_sharded(self) -> bool:
        """Each TP rank holds a different piece (counted once per TP rank in the global norm)."""
        return self.tp != "replicated"

    def tp_split(self) -> tuple[int, tuple[int, ...] | None] | None:
        """(dim, parts) of the TP split — parts None means one even split — or None when replicated."""
        if not self.tp_sharded:
            return None
        return self.dim, (self.parts or None)

    def partial_over_tp(self, sequence_parallel: bool) -> bool:
        """Whether the gradient must be summed over TP under this layout."""
        return self.tp_partial_grad == "always" or (self.tp_partial_grad == "sequence_parallel" and sequence_parallel)

    @property
    def grad_partial_over_tp(self) -> bool:
        """In a spec resolved for a layout (``ShardingSpec.for_layout``): the gradient is summed over TP."""
        return self.tp_partial_grad == "always"


REPLICATED = ParamSpec()


class ShardingSpec(Mapping):
    """``{tensor name: ParamSpec}`` for every parameter and persistent buffer of a whole model (all layers;
    a pipeline stage looks up the names it holds). ``family`` names the model family, for messages."""

    def __init__(self, entries: Mapping[str, ParamSpec], family: str = "") -> None:
        self._frozen = dict(entries)
        self.family = family

    def __getitem__(self, name: str) -> ParamSpec:
        try:
            return self._frozen[name]
        except KeyError:
            raise KeyError(f"{name}: no entry in the {self.family or 'model'} sharding spec "
                           "(every parameter and persistent buffer needs exactly one)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._frozen)

    def __len__(self) -> int:
        return len(self._frozen)

    def prefixed(self, prefix: str) -> ShardingSpec:
        """The same entries under ``prefix`` + name (a component of a larger model), ties renamed alike."""
        return ShardingSpec({prefix + n: (replace(s, tied_to=prefix + s.tied_to) if s.tied_to else s)
                             for n, s in self._frozen.items()}, self.family)

    def for_layout(self, sequence_parallel: bool) -> ShardingSpec:
        """The entries with ``tp_partial_grad`` resolved for a layout: ``sequence_parallel`` becomes ``always``
        (sequence parallelism on) or ``never``. A built model's ``sharding_spec()`` returns this form."""
        resolved = "always" if sequence_parallel else "never"
        return ShardingSpec({n: replace(s, tp_partial_grad=resolved) if s.tp_partial_grad == "sequence_parallel"
                             else s for n, s in self._frozen.items()}, self.family)

    def stored_name(self, name: str) -> str:
        """The global name ``name`` is stored under: a tied copy is stored as the tensor it copies."""
        return self[name].tied_to or name


def lora_adapter_entries(linear: str, weight: ParamSpec, dora: bool = False) -> dict[str, ParamSpec]:
    """The spec entries of a LoRA adapter (``mmtrain.model.lora``) on ``linear``, from its weight's entry. Column
    linear: ``B`` split like the weight (the same fused parts, its input already in the TP region), ``A`` whole,
    its gradient partial over TP (each rank back-propagates through its slice of ``B``). Row linear: ``A`` split
    like the weight (its partial outputs summed over TP), ``B`` whole (a partial gradient only under sequence
    parallelism). Replicated linear: ``A`` and ``B`` whole with the weight's partial-gradient rule (a linear that
    opens a TP region, ``tp_input: copy``, feeds per-rank column slices: its adapter's gradients are partial).
    ``dora``: also the DoRA magnitude (one per output feature): split like a column linear's output rows (its
    fused parts), else whole with ``B``'s partial-gradient rule (it scales the same outputs ``B`` writes)."""
    a, b, m = f"{linear}.adapter.lora_A.weight", f"{linear}.adapter.lora_B.weight", f"{linear}.adapter.magnitude"
    if weight.tp == "column":
        out = {a: ParamSpec(tp_partial_grad="always", adapter=True),
               b: ParamSpec("column", parts=weight.parts, unit=weight.unit, tp_input="local", adapter=True)}
        magnitude = ParamSpec("column", parts=weight.parts, unit=weight.unit, adapter=True)
    elif weight.tp == "row":
        out = {a: ParamSpec("row", unit=weight.unit, adapter=True),
               b: ParamSpec(tp_partial_grad="sequence_parallel", adapter=True)}
        magnitude = ParamSpec(tp_partial_grad="sequence_parallel", adapter=True)
    elif weight.tp != "replicated" or weight.expert_dim is not None:
        raise ValueError(f"{linear}: no LoRA adapter for a {weight.tp} / expert-sliced tensor")
    else:
        out = {a: ParamSpec(tp_partial_grad=weight.tp_partial_grad, adapter=True),
               b: ParamSpec(tp_partial_grad=weight.tp_partial_grad, adapter=True)}
        magnitude = ParamSpec(tp_partial_grad=weight.tp_partial_grad, adapter=True)
    if dora:
        out[m] = magnitude
    return out


def merge_specs(*specs: ShardingSpec, family: str = "") -> ShardingSpec:
    """One spec from components with disjoint names (a VLM: encoders, projector, language model)."""
    out: dict[str, ParamSpec] = {}
    for s in specs:
        clash = set(out) & set(s)
        if clash:
            raise ValueError(f"sharding specs overlap on {sorted(clash)[:3]}")
        out.update(s.items())
    return ShardingSpec(out, family)
