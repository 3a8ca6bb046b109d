"""What a model family's ``family.py`` declares: ``FAMILY = ModelFamily(...)``, written on the family's own shape
(its config section, ``ModelConfig.shape()``), and ``lazy``, which keeps a member's module unloaded until the
member is called (HF adapters, LoRA export: they import safetensors / transformers-sized code).

The registry (``mmtrain.models.registry``) checks a record against the contract and hands the shared code the
same members taking the run's ``ModelConfig``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


def lazy(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` as a function that imports the module on its first call and calls it."""
    module_name, _, name = target.partition(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module_name), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{target}, imported when first called."
    return call


def lazy_values(*targets: str) -> Callable[[], tuple[Any, ...]]:
    """``"package.module:Name"`` targets as a function returning their values (e.g. an adapter's error classes),
    importing the modules on its first call."""
    def values() -> tuple[Any, ...]:
        found = []
        for target in targets:
            module_name, _, name = target.partition(":")
            found.append(getattr(importlib.import_module(module_name), name))
        return tuple(found)
    return values


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face bridge on full tensors, written on the family's shape ``S``:
    ``model_types`` (HF ``model_type`` values it reads), ``config_from_hf(config.json mapping) -> S``,
    ``config_to_hf(S, base) -> mapping``, ``state_from_hf(hf tensors, S)``, ``state_to_hf(full tensors, S)``;
    ``errors()``: the exception classes its refusals raise (one-line messages naming the key);
    ``merge_lora(full, S, lora) -> base tensors`` and ``lora_to_peft(full, S, lora, base_model) ->
    (adapter_config.json mapping, peft-named tensors)``, None where the family exports no LoRA adapters
    (``lora`` arrives with its targets resolved: ``LoraConfig.targets_for``)."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], Any]
    config_to_hf: Callable[..., dict[str, Any]]
    state_from_hf: Callable[..., dict]
    state_to_hf: Callable[..., dict]
    errors: Callable[[], tuple[type[Exception], ...]]
    merge_lora: Callable | None = None
    lora_to_peft: Callable | None = None


class NoHFAdapterError(ValueError):
    """A family without a Hugging Face bridge was asked to convert (one line naming the family)."""


def no_hf_adapter(family: str) -> HFAdapter:
    """The ``hf`` of a family with no Hugging Face bridge (yet): it reads no ``model_type`` and every conversion
    is a one-line ``NoHFAdapterError``, which the convert CLI reports like any adapter's refusal."""
    def refuse(*args, **kwargs):
        raise NoHFAdapterError(f"model family {family!r} has no Hugging Face adapter (its family.py declares "
                               "no_hf_adapter); it trains, checkpoints and decodes, but does not convert")
    return HFAdapter((), refuse, refuse, refuse, refuse, lambda: (NoHFAdapterError,))


@dataclass(frozen=True)
class ModelFamily:
    """A family's registry record (docs/adding-a-model-family.md), every member on the family's shape ``S``:

    - ``stage_class`` / ``block_classes``: the ``FamilyStage`` a build makes and the ``FamilyBlock`` classes its
      ``layers`` hold (``mmtrain.models.contract``); the stage class is built as ``stage_class(S, layer_range,
      pre_process=, post_process=, attention=, moe_dispatch=, lora=)`` unless ``build_stage`` (same arguments,
      positional) is given;
    - ``flops_per_token(S, seq_length)``: training FLOPs per token;
    - ``has_routed_experts(S)``: whether it has MoE layers (expert parallelism, router-bias balancing apply);
    - ``architecture(S)``: the fields that change what the weights compute (a run loading weights must agree);
    - ``hf``: its ``HFAdapter`` (``no_hf_adapter(name)`` for a family without one);
    - ``sharding_spec(S)``: the whole model's ``ShardingSpec``; None: the stage class built whole on the meta
      device reports it.
    """

    stage_class: type
    block_classes: tuple[type, ...]
    flops_per_token: Callable[[Any, int], float]
    has_routed_experts: Callable[[Any], bool]
    architecture: Callable[[Any], dict[str, Any]]
    hf: HFAdapter
    sharding_spec: Callable[[Any], Any] | None = None
    build_stage: Callable[..., Any] | None = None
