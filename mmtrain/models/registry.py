"""Model families by ``model.family``: what the trainer needs of each, so that it names no family's classes.

A family is a ``ModelFamily``: ``build_stage(model_cfg, layer_range, pre_process, post_process)`` makes one
pipeline stage (global layer names, not yet initialized: the caller runs ``init_weights(seed)``),
``flops_per_token(model_cfg, seq_length)`` its training FLOPs per token, ``has_routed_experts(model_cfg)``
whether it has MoE layers (the expert-parallel plan and the router-bias balancing apply). Adding a family is one
entry in ``FAMILIES`` and a ``Literal`` value of ``ModelConfig.family``. Imports happen on first use, so the
registry stays cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from mmtrain.config.schema import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    build_stage: Callable[[ModelConfig, tuple[int, int], bool, bool], nn.Module]
    flops_per_token: Callable[[ModelConfig, int], float]
    has_routed_experts: Callable[[ModelConfig], bool]


def _llama_stage(m: ModelConfig, layer_range: tuple[int, int], pre: bool, post: bool) -> nn.Module:
    from mmtrain.models.llama.model import GPTModel

    return GPTModel(m, layer_range, pre_process=pre, post_process=post)


def _llama_flops(m: ModelConfig, seq_length: int) -> float:
    from mmtrain.models.llama.model import flops_per_token

    return flops_per_token(m, seq_length)


def _deepseek_v3_stage(m: ModelConfig, layer_range: tuple[int, int], pre: bool, post: bool) -> nn.Module:
    from mmtrain.models.deepseek_v3.model import DeepseekV3Model

    return DeepseekV3Model(m.deepseek_v3, layer_range, pre_process=pre, post_process=post)


def _deepseek_v3_flops(m: ModelConfig, seq_length: int) -> float:
    from mmtrain.models.deepseek_v3.flops import flops_per_token

    return flops_per_token(m.deepseek_v3, seq_length)


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(_llama_stage, _llama_flops, lambda m: m.num_experts > 0),
    "deepseek_v3": ModelFamily(_deepseek_v3_stage, _deepseek_v3_flops,
                               lambda m: m.deepseek_v3.first_k_dense_replace < m.deepseek_v3.num_layers),
}


def model_family(m: ModelConfig) -> ModelFamily:
    """The family ``m.family`` names (the config's ``Literal`` already refused any other name)."""
    return FAMILIES[m.family]
