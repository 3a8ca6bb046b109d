"""Model families by ``model.family``: what the trainer needs of each, so that it names no family's classes.

The families are the table of ``mmtrain.models.families`` (name -> package). A family's record is the
``FAMILY = ModelFamily(...)`` of its ``<package>.family`` module (``mmtrain.models.family_record``), loaded the
first time a run uses the family (so its torch modules load then), checked against the contract
(``mmtrain.models.contract``: a one-line ``FamilyContractError`` naming the missing member) and kept in
``FAMILIES``. The record is written on the family's shape; ``model_family(model_cfg)`` hands the shared code the
same members taking the run's ``ModelConfig``:

``build_stage(model_cfg, layer_range, pre_process, post_process, attention=None, moe_dispatch=None, lora=None)``
makes one pipeline stage (global layer names, not yet initialized: the caller runs ``init_weights(seed)``;
``attention``: a strategy of ``mmtrain.model.attention``, None for the default; ``moe_dispatch``: a
``mmtrain.parallel.moe_dispatch`` strategy; ``lora``: the run's ``LoraConfig``, its targets resolved here),
checked for the contract's attributes; ``flops_per_token(model_cfg, seq_length)``,
``has_routed_experts(model_cfg)``, ``sharding_spec(model_cfg)`` (the whole model's), ``architecture(model_cfg)``
(keys under the model section: ``hidden_size``, ``deepseek_v3.hidden_size``), ``hf`` (an ``HFAdapter`` on
``ModelConfig``\\ s), ``stage_class`` / ``block_classes``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch
from torch import nn

from mmtrain.config.loader import ConfigError
from mmtrain.config.schema import ModelConfig
from mmtrain.models.contract import FamilyContractError, check_family_classes, check_stage_attributes
from mmtrain.models.families import FAMILY_PACKAGES, INLINE_FAMILY, unknown_family_message
from mmtrain.models.family_record import HFAdapter, ModelFamily

__all__ = ["FAMILIES", "HFAdapter", "ModelFamily", "family_for_hf", "family_named", "hf_errors", "model_family",
           "register_family"]

FAMILIES: dict[str, ModelFamily] = {}  # the families loaded so far (and any registered at run time), as called


def _resolved_lora(lora, m: ModelConfig):
    """``lora`` with its targets resolved for ``m`` (empty = all the family's shape has), or None without LoRA."""
    if lora is None or not lora.rank:
        return None
    return dataclasses.replace(lora, targets=list(lora.targets_for(m)))


def _whole_model_spec(stage_class: type) -> Callable:
    def sharding_spec(shape):
        with torch.device("meta"):
            return stage_class(shape).sharding_spec()
    return sharding_spec


def _checked_build(name: str, family: ModelFamily) -> Callable[..., nn.Module]:
    """The family's stage builder on a ``ModelConfig``; the stage is checked for the contract's attributes (set
    in its constructor) and its blocks for the registered block classes."""
    def build_stage(m: ModelConfig, layer_range=None, pre_process: bool = True, post_process: bool = True,
                    attention=None, moe_dispatch=None, lora=None) -> nn.Module:
        shape, lora = m.shape(), _resolved_lora(lora, m)
        if family.build_stage is not None:
            stage = family.build_stage(shape, layer_range, pre_process, post_process, attention, moe_dispatch, lora)
        else:
            stage = family.stage_class(shape, layer_range, pre_process=pre_process, post_process=post_process,
                                       attention=attention, moe_dispatch=moe_dispatch, lora=lora)
        check_stage_attributes(name, stage)
        for index, block in stage.layers.items():
            if not isinstance(block, family.block_classes):
                raise FamilyContractError(f"model family {name!r}: layers.{index} is a {type(block).__name__}, "
                                          "not one of its registered block_classes")
        return stage
    return build_stage


def _on_run_config(name: str, family: ModelFamily) -> ModelFamily:
    """``family``'s members, written on its shape, as the shared code calls them: on a ``ModelConfig``."""
    hf, spec = family.hf, family.sharding_spec or _whole_model_spec(family.stage_class)
    prefix = "" if name == INLINE_FAMILY else f"{name}."  # where the shape's keys sit under the model section

    def run_config(shape) -> ModelConfig:  # the inline family's shape is a ModelConfig already
        return shape if name == INLINE_FAMILY else ModelConfig(family=name, **{name: shape})

    def merge_lora(full, m, lora):
        return hf.merge_lora(full, m.shape(), _resolved_lora(lora, m))

    def lora_to_peft(full, m, lora, base_model=""):
        return hf.lora_to_peft(full, m.shape(), _resolved_lora(lora, m), base_model)

    adapter = HFAdapter(hf.model_types, lambda d: run_config(hf.config_from_hf(d)),
                        lambda m, base=None: hf.config_to_hf(m.shape(), base),
                        lambda tensors, m: hf.state_from_hf(tensors, m.shape()),
                        lambda full, m: hf.state_to_hf(full, m.shape()), hf.errors,
                        merge_lora if hf.merge_lora is not None else None,
                        lora_to_peft if hf.lora_to_peft is not None else None)
    return dataclasses.replace(
        family, build_stage=_checked_build(name, family), hf=adapter, sharding_spec=lambda m: spec(m.shape()),
        flops_per_token=lambda m, seq_length: family.flops_per_token(m.shape(), seq_length),
        has_routed_experts=lambda m: family.has_routed_experts(m.shape()),
        architecture=lambda m: {prefix + k: v for k, v in family.architecture(m.shape()).items()})


def _check_record(name: str, family: Any) -> ModelFamily:
    if not isinstance(family, ModelFamily):
        raise FamilyContractError(f"model family {name!r}: FAMILY is a {type(family).__name__}, not a "
                                  "mmtrain.models.family_record.ModelFamily")
    for field in ("flops_per_token", "has_routed_experts", "architecture"):
        if not callable(getattr(family, field)):
            raise FamilyContractError(f"model family {name!r}: ModelFamily.{field} is not callable")
    for field in ("sharding_spec", "build_stage"):
        if getattr(family, field) is not None and not callable(getattr(family, field)):
            raise FamilyContractError(f"model family {name!r}: ModelFamily.{field} is not callable")
    if not isinstance(family.hf, HFAdapter):
        raise FamilyContractError(f"model family {name!r}: ModelFamily.hf is not an HFAdapter")
    family = dataclasses.replace(family, block_classes=tuple(family.block_classes))
    check_family_classes(name, family.stage_class, family.block_classes)
    return family


def register_family(name: str, family: ModelFamily) -> None:
    """Add ``family`` under ``name`` at run time after checking it against the contract
    (``mmtrain.models.contract``): every record member of the right kind, the stage class's and each block
    class's methods present. Raises ``FamilyContractError`` naming the family, class and missing member. The
    table's families register themselves when first used (``family_named``)."""
    if name in FAMILIES or name in FAMILY_PACKAGES:
        raise FamilyContractError(f"model family {name!r} is registered twice (the table "
                                  "mmtrain/models/families.py has it)" if name in FAMILY_PACKAGES else
                                  f"model family {name!r} is registered twice")
    FAMILIES[name] = _on_run_config(name, _check_record(name, family))


def family_named(name: str) -> ModelFamily:
    """The family ``name``: loaded from its package's ``family`` module on first use and checked."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name not in FAMILY_PACKAGES:
        raise ConfigError(unknown_family_message(name))
    module_name = f"{FAMILY_PACKAGES[name]}.family"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not (exc.name == module_name or module_name.startswith(f"{exc.name}.")):
            raise  # the module is there; something it imports is not
        raise FamilyContractError(f"model family {name!r}: no module {module_name} (its FAMILY record; "
                                  "docs/adding-a-model-family.md)") from None
    if not hasattr(module, "FAMILY"):
        raise FamilyContractError(f"model family {name!r}: {module_name} defines no FAMILY = ModelFamily(...)")
    FAMILIES[name] = _on_run_config(name, _check_record(name, module.FAMILY))
    return FAMILIES[name]


def model_family(m: ModelConfig) -> ModelFamily:
    """The family ``m.family`` names."""
    return family_named(m.family)


def _every_family() -> list[ModelFamily]:
    return [family_named(name) for name in FAMILY_PACKAGES]


def family_for_hf(hf_config: dict[str, Any]) -> ModelFamily:
    """The family whose adapter reads this HF ``config.json`` (by ``model_type``); the inline (Llama) family
    otherwise, whose adapter names what it cannot read."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    return next((f for f in _every_family() if model_type in f.hf.model_types), family_named(INLINE_FAMILY))


def hf_errors() -> tuple[type[Exception], ...]:
    """Every family adapter's refusal classes (for one-line CLI errors)."""
    return tuple(e for f in _every_family() for e in f.hf.errors())
