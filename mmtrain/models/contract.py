"""The family contract: everything the shared code (build, compile, recompute, the TP/SP plan, pipeline chunks,
FSDP, the expert-parallel plan and router-bias balancing, checkpoints, the HF bridge, the FLOP count, KV-cache
decoding) may use of a model family.

A family is a folder ``mmtrain/models/<family>/`` plus one line in the family table ``mmtrain/models/families.py``
(docs/adding-a-model-family.md). Its registry record (``ModelFamily`` in its ``family.py``) holds the
config-level members: FLOPs per token, MoE flag, sharding spec, architecture fields, HF adapter, and the stage
and block classes, which implement the protocols below. Registering (``mmtrain.models.registry``) checks them
(``check_family_classes``: a missing method is a one-line ``FamilyContractError`` naming family, class and
member); every built stage is checked for the attributes (``check_stage_attributes``). Shared code calls these
members and nothing else of a family's modules: no ``hasattr`` dispatch, no branch on the family's name.

``FamilyStage`` (what ``build_stage`` returns: the whole model or one pipeline stage of it):

- ``layers``: an ``nn.ModuleDict`` of this stage's blocks by *global* layer index (``"7"``), in forward order,
  each a ``FamilyBlock``. FSDP makes each block a fully sharded unit; virtual pipeline chunks merge them.
- ``pre_process`` / ``post_process``: the stage holds the embedding / the final norm, output layer and loss.
- ``forward(inputs, labels_BS=None, position_ids_BS=None, doc_ids_BS=None)``: token ids (B, S) on the first
  stage, hidden states (B, S, D) on the others; returns per-token losses (B, S) on the last stage when labels
  are given, else logits (last stage) or hidden states. ``doc_ids_BS``: the packed documents of each token.
- ``init_weights(seed)``: deterministic per-name init, so every layout starts from the same values.
- ``compile_head()``: compile what of the output head's loss path is worth compiling on one TP rank (the family
  decides: the cross-entropy; the Llama family with an FP8 output layer its whole logits-and-loss method);
  nothing on a stage without a head.
- ``new_kv_cache(slots, max_len, dtype, device)``: a static cache (``mmtrain.model.kv_cache``: preallocated,
  rows by position) for ``decode``, sized for the model as it is on this rank (a TP shard's heads).
- ``decode(cache, positions_BS, tokens_BS=None, inputs_embeds=None, slots_B=None, last_index_B=None,
  kv_len=None)``: the cached forward of a whole model (generation, the server): new tokens (or embeddings) of
  cache rows ``slots_B`` at ``positions_BS``, what its attention caches written to ``cache``; fp32 logits over the
  whole vocabulary (B, V) of one position per row (``last_index_B``, default the last). Its blocks' ``decode``
  with the same ops as their ``forward`` but the attention core, so a compiled decode step stays one graph.
  What the engine relies on (``mmtrain.inference.engine``), which a family with a recurrent state (Nemotron-H's
  Mamba layers: ``mmtrain.models.nemotron_h.decode``) keeps as attention does by position: a row whose first
  position is 0 starts a new sequence (whatever its slot held is not read: free slots decode garbage at position
  0, a finished row may be decoded once more, a failed prefill is retried from position 0); positions after
  ``last_index_B`` are right-padding of a batched prefill and leave the row as after its last real token; a call
  whose first position is p > 0 continues the row (a prompt prefilled in pieces). Nothing is rewound.
- and the ``TensorParallelModel`` members:

``TensorParallelModel`` (what ``mmtrain.parallel.tensor.apply_tensor_parallel`` shards: a stage, a VLM encoder):

- ``sharding_spec()``: the whole model's ``ShardingSpec`` (``mmtrain.models.spec``), resolved for the layout
  ``set_sequence_parallel`` set. The TP plan, gradient finalisation, checkpoints and the HF bridge read it.
- ``set_sequence_parallel(sequence_parallel)``: the layout the TP plan applies (which gradients are partial
  over TP); a model that cannot be sequence-parallel refuses True.
- ``swap_head(make_head)``: replace the output head (a ``mmtrain.model.head.LossHead``-like strategy: prepare,
  logits, loss, full_logits, compile_loss, matmul) by ``make_head(head, vocab_size)``; a model without a head
  does nothing. The TP plan swaps in its vocab-parallel head so.

``FamilyBlock`` (each value of ``layers``):

- ``set_recompute(mode)``: ``mode`` one of ``RECOMPUTE_MODES``: ``none``; ``selective`` (recompute the dense
  MLP's activation in backward; a block without a dense MLP keeps everything); ``full`` (keep only the block's
  input, recompute the rest).
- ``compile_parts(scope)``: ``torch.compile`` what of the block may be compiled under ``scope``, one of
  ``COMPILE_SCOPES``: ``block`` (nothing outside needs the block's call eager), ``inside_call`` (hooks sit on
  the block's call, e.g. FSDP's gather/free: compile only what runs inside it), ``no_linears`` (the linears run
  kernels dynamo does not trace, e.g. Transformer Engine: compile only the rest). The block narrows it where it
  must (an MoE block compiles its dense parts only: token counts per expert are data-dependent).
- ``decode(x, cos, sin, cache, layer, slots_B, positions_BS, kv_len)``: the block's cached forward (``layer``:
  its index in the cache), called by the stage's ``decode`` (which may pass more, e.g. ``last_index_B``).

MoE layers derive from ``RoutedExpertsLayer``: how the expert-parallel plan and the router-bias balancing find
them and what they read.

Plain Python (no torch): ``mmtrain.parallel`` may import this module, never a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from mmtrain.models.families import FamilyContractError  # with the table: the config layer raises it too

if TYPE_CHECKING:
    from mmtrain.models.spec import ShardingSpec

RECOMPUTE_MODES = ("none", "selective", "full")
COMPILE_SCOPES = ("block", "inside_call", "no_linears")

# What registering checks: methods on the classes, attributes (set by the constructor) on every built stage.
TENSOR_PARALLEL_METHODS = ("sharding_spec", "set_sequence_parallel", "swap_head")
STAGE_METHODS = ("forward", "init_weights", "compile_head", "new_kv_cache", "decode", *TENSOR_PARALLEL_METHODS)
STAGE_ATTRIBUTES = ("layers", "pre_process", "post_process")
BLOCK_METHODS = ("forward", "set_recompute", "compile_parts", "decode")


class TensorParallelModel(Protocol):
    """What the TP plan shards (see the module docstring)."""

    def sharding_spec(self) -> ShardingSpec: ...

    def set_sequence_parallel(self, sequence_parallel: bool) -> None: ...

    def swap_head(self, make_head: Callable[[Any, int], Any]) -> None: ...


class FamilyBlock(Protocol):
    """One block of a stage's ``layers`` (see the module docstring)."""

    def set_recompute(self, mode: str) -> None: ...

    def compile_parts(self, scope: str) -> None: ...

    def decode(self, x: Any, cos: Any, sin: Any, cache: Any, layer: int, slots_B: Any, positions_BS: Any,
               kv_len: int | None) -> Any: ...


class FamilyStage(TensorParallelModel, Protocol):
    """What a family's ``build_stage`` returns (see the module docstring)."""

    layers: Any  # nn.ModuleDict: global layer index -> FamilyBlock
    pre_process: bool
    post_process: bool

    def init_weights(self, seed: int) -> None: ...

    def compile_head(self) -> None: ...

    def new_kv_cache(self, slots: int, max_len: int, dtype: Any, device: Any) -> Any: ...

    def decode(self, cache: Any, positions_BS: Any, tokens_BS: Any = None, inputs_embeds: Any = None,
               slots_B: Any = None, last_index_B: Any = None, kv_len: int | None = None) -> Any: ...


class LanguageStageDefaults:
    """The tensor-parallel members of ``FamilyStage``, and its output layer, as a language model with
    ``cfg.vocab_size``, an ``embed`` and an optional ``output`` linear (None: tied to the embedding) and ``head``
    (None off the last pipeline stage) implements them: a family's stage class may inherit them and override
    what differs (soft-capped logits, an FP8 head's compiled loss)."""

    def output_weight(self):
        """The output layer's weight: its own, or the embedding's when tied."""
        return self.output.weight if self.output is not None else self.embed.weight

    def logits(self, x):
        """The output layer on the (normalized) hidden states: this rank's vocabulary shard under TP."""
        return self.head.logits(x, self.output_weight())

    def compile_head(self) -> None:
        """The family contract's head hook: the cross-entropy (fuses the fp32 upcast, log-softmax and backward)."""
        if self.head is not None:
            self.head.compile_loss()

    def set_sequence_parallel(self, sequence_parallel: bool) -> None:
        """The layout the TP plan applied: the spec's partial gradients follow it."""
        self.sequence_parallel = sequence_parallel

    def swap_head(self, make_head) -> None:
        """The output head replaced by ``make_head(head, vocab_size)`` (the TP plan's vocab-parallel head)."""
        if self.head is not None:
            self.head = make_head(self.head, self.cfg.vocab_size)


class RoutedExpertsLayer:
    """Base class of a family's MoE layer: what the expert-parallel plan (``mmtrain.parallel.expert``) and the
    router-bias balancing read. ``dispatch``: its token-dispatch strategy (``mmtrain.parallel.moe_dispatch``,
    taken at construction; says which experts this rank holds); ``step_load``: tokens per expert counted since
    the last bias update (training only), or None; ``bias_update_rate``: per-step move of ``router.expert_bias``
    toward balance, 0 for a router without a selection bias."""

    dispatch: Any
    step_load: Any
    bias_update_rate: float = 0.0
    router: Any


def check_family_classes(family: str, stage_class: type, block_classes: tuple[type, ...]) -> None:
    """Raise ``FamilyContractError`` naming the first class of a registering family that lacks a method of its
    protocol (``STAGE_METHODS`` / ``BLOCK_METHODS``)."""
    if not block_classes:
        raise FamilyContractError(f"model family {family!r}: ModelFamily.block_classes names no block class")
    for cls, methods, protocol in [(stage_class, STAGE_METHODS, "FamilyStage"),
                                   *[(b, BLOCK_METHODS, "FamilyBlock") for b in block_classes]]:
        absent = [m for m in methods if not callable(getattr(cls, m, None))]
        if absent:
            raise FamilyContractError(f"model family {family!r}: {cls.__name__} lacks {', '.join(absent)} "
                                      f"(mmtrain.models.contract.{protocol}; docs/adding-a-model-family.md)")


def check_stage_attributes(family: str, stage: object) -> None:
    """Raise ``FamilyContractError`` when a built stage did not set an attribute of ``STAGE_ATTRIBUTES``."""
    absent = [a for a in STAGE_ATTRIBUTES if not hasattr(stage, a)]
    if absent:
        raise FamilyContractError(f"model family {family!r}: the stage {type(stage).__name__} sets no "
                                  f"{', '.join(absent)} (mmtrain.models.contract.FamilyStage)")


def check_recompute_mode(mode: str) -> None:
    """A one-line error for a recompute mode outside ``RECOMPUTE_MODES``."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}; expected one of {', '.join(RECOMPUTE_MODES)}")


def check_compile_scope(scope: str) -> None:
    """A one-line error for a compile scope outside ``COMPILE_SCOPES``."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}; expected one of {', '.join(COMPILE_SCOPES)}")
