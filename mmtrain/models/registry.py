"""Model families by ``model.family``: what the trainer needs of each, so that it names no family's classes.

A family is a ``ModelFamily``: ``build_stage(model_cfg, layer_range, pre_process, post_process, attention,
moe_dispatch=None)`` makes one pipeline stage (global layer names, not yet initialized: the caller runs
``init_weights(seed)``; ``attention``: the attention strategy of ``mmtrain.model.attention``, None for the
default; its MoE layers take ``moe_dispatch``, a ``mmtrain.parallel.moe_dispatch`` strategy),
``flops_per_token(model_cfg, seq_length)`` its training FLOPs per token, ``has_routed_experts(model_cfg)``
whether it has MoE layers (the expert-parallel plan and the router-bias balancing apply),
``sharding_spec(model_cfg)`` the whole model's spec (checkpoints, the HF bridge), ``architecture(model_cfg)``
the fields that change what the weights compute (a run loading weights must agree on all), and ``hf``: its
Hugging Face adapter (``HFAdapter``); ``stage_class`` / ``block_classes``: the classes ``build_stage`` makes,
which implement the family contract (``mmtrain.models.contract``: ``FamilyStage``, ``FamilyBlock``).
Adding a family is one ``register_family`` line and a ``Literal`` value of ``ModelConfig.family``; registering
checks the record and those classes against the contract (a one-line ``FamilyContractError`` naming the missing
member), and every built stage is checked for the contract's attributes. The HF adapters import on first use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from mmtrain.config.schema import ModelConfig
from mmtrain.model.layers import TransformerBlock
from mmtrain.models.contract import FamilyContractError, check_family_classes, check_stage_attributes
from mmtrain.models.deepseek_v3.model import DecoderLayer, DeepseekV3Model
from mmtrain.models.llama.model import GPTModel
from mmtrain.models.spec import ShardingSpec


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face bridge on full tensors: ``model_types`` (HF ``model_type`` values it reads),
    ``config_from_hf(config.json mapping) -> ModelConfig``, ``config_to_hf(model_cfg, base)``,
    ``state_from_hf(hf tensors, model_cfg)``, ``state_to_hf(full tensors, model_cfg)``; ``errors()``: the
    exception classes its refusals raise (one-line messages naming the key)."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_to_hf: Callable[[ModelConfig, dict[str, Any] | None], dict[str, Any]]
    state_from_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    state_to_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    errors: Callable[[], tuple[type[Exception], ...]]
    # LoRA on full tensors (None: the family has no adapters): merge_lora(full, cfg, lora) -> base tensors;
    # lora_to_peft(full, cfg, lora, base_model) -> (adapter_config.json mapping, peft-named tensors)
    merge_lora: Callable | None = None
    lora_to_peft: Callable | None = None


@dataclass(frozen=True)
class ModelFamily:
    build_stage: Callable[..., nn.Module]  # (model_cfg, layer_range, pre, post, attention=None, moe_dispatch=None)
    flops_per_token: Callable[[ModelConfig, int], float]
    has_routed_experts: Callable[[ModelConfig], bool]
    sharding_spec: Callable[[ModelConfig], ShardingSpec]
    architecture: Callable[[ModelConfig], dict[str, Any]]
    hf: HFAdapter
    stage_class: type  # what build_stage returns: a FamilyStage
    block_classes: tuple[type, ...]  # what its ``layers`` hold: FamilyBlocks


def _llama_stage(m: ModelConfig, layer_range: tuple[int, int], pre: bool, post: bool, attention=None,
                 moe_dispatch=None, lora=None) -> nn.Module:
    return GPTModel(m, layer_range, pre_process=pre, post_process=post, attention=attention,
                    moe_dispatch=moe_dispatch, lora=lora)


def _llama_flops(m: ModelConfig, seq_length: int) -> float:
    from mmtrain.models.llama.model import flops_per_token

    return flops_per_token(m, seq_length)


def _deepseek_v3_stage(m: ModelConfig, layer_range: tuple[int, int], pre: bool, post: bool,
                       attention=None, moe_dispatch=None, lora=None) -> nn.Module:
    return DeepseekV3Model(m.deepseek_v3, layer_range, pre_process=pre, post_process=post, attention=attention,
                           moe_dispatch=moe_dispatch, lora=_resolved_lora(lora, m))


def _resolved_lora(lora, m: ModelConfig):
    """``lora`` with its targets resolved for ``m`` (empty = all the family allows), or None without LoRA."""
    if lora is None or not lora.rank:
        return None
    return dataclasses.replace(lora, targets=list(lora.targets_for(m)))


def _deepseek_v3_flops(m: ModelConfig, seq_length: int) -> float:
    from mmtrain.models.deepseek_v3.flops import flops_per_token

    return flops_per_token(m.deepseek_v3, seq_length)


def _llama_spec(m: ModelConfig) -> ShardingSpec:
    from mmtrain.models.llama.spec import llama_sharding_spec

    return llama_sharding_spec(m)


# Llama shape fields that change what the weights compute (not name, init_std, routing-bias or loss settings)
LLAMA_ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                             "num_query_groups", "head_dim", "vocab_size", "norm", "norm_eps", "activation",
                             "rope_theta", "rope_scaling_factor", "tie_embeddings", "add_bias", "qkv_bias",
                             "qk_norm", "num_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_router",
                             "moe_norm_topk_prob", "moe_dense_layers", "moe_shared_ffn_hidden_size")


def _llama_architecture(m: ModelConfig) -> dict[str, Any]:
    """``LLAMA_ARCHITECTURE_FIELDS`` of ``m``; ``head_dim`` as the model uses it (0 and the width it stands for
    build the same weights), ``moe_dense_layers`` in order."""
    resolved = {"head_dim": m.attention_head_dim, "moe_dense_layers": sorted(m.moe_dense_layers)}
    return {k: resolved.get(k, getattr(m, k)) for k in LLAMA_ARCHITECTURE_FIELDS}


def _llama_hf() -> HFAdapter:
    def lazy(name):
        def call(*args):
            from mmtrain.models.llama import hf_adapter

            return getattr(hf_adapter, name)(*args)
        return call

    def errors():
        from mmtrain.models.llama.hf_adapter import UnsupportedHFConfig

        return (UnsupportedHFConfig,)
    def lora(name):
        def call(*args):
            from mmtrain.models.llama import lora_export

            return getattr(lora_export, name)(*args)
        return call

    return HFAdapter(("llama", "qwen2", "mixtral", "qwen3", "qwen3_moe"), lazy("model_config_from_hf"),
                     lazy("hf_config_from_model_config"), lazy("mmtrain_state_from_hf"),
                     lazy("hf_state_from_mmtrain"), errors, lora("merge_lora"), lora("peft_adapter"))


def _deepseek_v3_spec(m: ModelConfig) -> ShardingSpec:
    with torch.device("meta"):
        return DeepseekV3Model(m.deepseek_v3).sharding_spec()


def _deepseek_v3_architecture(m: ModelConfig) -> dict[str, Any]:
    shape = dataclasses.asdict(m.deepseek_v3)
    for key in ("name", "init_std", "bias_update_rate"):  # naming, initialization and balancing only
        shape.pop(key)
    return {f"deepseek_v3.{k}": v for k, v in shape.items()}


def _deepseek_v3_hf() -> HFAdapter:
    def config_from_hf(hf):
        from mmtrain.models.deepseek_v3.hf_adapter import config_from_hf as read

        return ModelConfig(family="deepseek_v3", deepseek_v3=read(hf))

    def config_to_hf(m, base=None):
        from mmtrain.models.deepseek_v3.hf_adapter import config_to_hf as write

        return write(m.deepseek_v3, base)

    def state_from_hf(tensors, m):
        from mmtrain.models.deepseek_v3.hf_adapter import state_dict_from_hf

        return state_dict_from_hf(tensors, m.deepseek_v3)

    def state_to_hf(full, m):
        from mmtrain.models.deepseek_v3.hf_adapter import state_dict_to_hf

        return state_dict_to_hf(full, m.deepseek_v3)

    def errors():
        from mmtrain.models.deepseek_v3.hf_adapter import HFAdapterError

        return (HFAdapterError,)

    def merge_lora(full, m, lora):
        from mmtrain.models.deepseek_v3.lora_export import merge_lora as merge

        return merge(full, m.deepseek_v3, _resolved_lora(lora, m))

    def lora_to_peft(full, m, lora, base_model=""):
        from mmtrain.models.deepseek_v3.lora_export import peft_adapter

        return peft_adapter(full, m.deepseek_v3, _resolved_lora(lora, m), base_model)
    return HFAdapter(("deepseek_v3",), config_from_hf, config_to_hf, state_from_hf, state_to_hf, errors,
                     merge_lora, lora_to_peft)


FAMILIES: dict[str, ModelFamily] = {}


def _checked_build(name: str, family: ModelFamily) -> Callable[..., nn.Module]:
    """The family's ``build_stage``, its stage checked for the contract's attributes (set in its constructor)
    and its blocks for the registered block classes."""
    def build_stage(*args, **kwargs) -> nn.Module:
        stage = family.build_stage(*args, **kwargs)
        check_stage_attributes(name, stage)
        for index, block in stage.layers.items():
            if not isinstance(block, family.block_classes):
                raise FamilyContractError(f"model family {name!r}: layers.{index} is a {type(block).__name__}, "
                                          "not one of its registered block_classes")
        return stage
    return build_stage


def register_family(name: str, family: ModelFamily) -> None:
    """Add ``family`` under ``name`` (the ``model.family`` value) after checking it against the contract
    (``mmtrain.models.contract``): every record member of the right kind, the stage class's and each block
    class's methods present. Raises ``FamilyContractError`` naming the family, class and missing member."""
    if name in FAMILIES:
        raise FamilyContractError(f"model family {name!r} is registered twice")
    for field in ("build_stage", "flops_per_token", "has_routed_experts", "sharding_spec", "architecture"):
        if not callable(getattr(family, field)):
            raise FamilyContractError(f"model family {name!r}: ModelFamily.{field} is not callable")
    if not isinstance(family.hf, HFAdapter):
        raise FamilyContractError(f"model family {name!r}: ModelFamily.hf is not an HFAdapter")
    family = dataclasses.replace(family, block_classes=tuple(family.block_classes))
    check_family_classes(name, family.stage_class, family.block_classes)
    FAMILIES[name] = dataclasses.replace(family, build_stage=_checked_build(name, family))


register_family("llama", ModelFamily(
    _llama_stage, _llama_flops, lambda m: any(m.moe_layer(i) for i in range(m.num_layers)), _llama_spec,
    _llama_architecture, _llama_hf(), GPTModel, (TransformerBlock,)))
register_family("deepseek_v3", ModelFamily(
    _deepseek_v3_stage, _deepseek_v3_flops, lambda m: m.deepseek_v3.first_k_dense_replace < m.deepseek_v3.num_layers,
    _deepseek_v3_spec, _deepseek_v3_architecture, _deepseek_v3_hf(), DeepseekV3Model, (DecoderLayer,)))


def model_family(m: ModelConfig) -> ModelFamily:
    """The family ``m.family`` names (the config's ``Literal`` already refused any other name)."""
    return FAMILIES[m.family]


def family_for_hf(hf_config: dict[str, Any]) -> ModelFamily:
    """The family whose adapter reads this HF ``config.json`` (by ``model_type``); the Llama family otherwise,
    whose adapter names what it cannot read."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    return next((f for f in FAMILIES.values() if model_type in f.hf.model_types), FAMILIES["llama"])


def hf_errors() -> tuple[type[Exception], ...]:
    """Every family adapter's refusal classes (for one-line CLI errors)."""
    return tuple(e for f in FAMILIES.values() for e in f.hf.errors())
