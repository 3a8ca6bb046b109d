"""LoRA for the DeepSeek-V3 family: which linears a target names and adapting a model (the adapters on full
tensors, merged or as a ``peft`` adapter with ``DeepseekV3ForCausalLM``'s module names: ``lora_export.py``).

Targets (``peft.lora.targets``; ``DEEPSEEK_V3_LORA_TARGETS``): MLA's ``q_down``/``q_up`` (HF ``q_a_proj`` /
``q_b_proj``; ``q_proj`` without a query latent), ``kv_down`` (``kv_a_proj_with_mqa``: [latent | shared rope
key], one adapter over both parts), ``kv_up`` (``kv_b_proj``), ``proj`` (``o_proj``); the dense layers' ``up``
([gate | up]: HF ``gate_proj`` and ``up_proj``, the same ``A`` and each its rows of ``B``) and ``down``; the MoE
layers' shared experts ``shared_up`` / ``shared_down`` (``mlp.shared_experts.*``). The routed experts are not
adapted: they are grouped-GEMM tensors here and fused parameters in transformers, not linears ``peft`` targets.
How each adapter is sharded follows from its linear's rule (``spec.py``, ``lora_adapter_entries``): the latent
down-projections open the TP region, so their adapters stay whole with partial gradients.

The ``peft`` adapter export holds the attention targets only. ``peft`` (0.21, with transformers 5) rewrites any
``gate_proj`` / ``up_proj`` / ``down_proj`` target of a DeepseekV3 model into the routed experts' fused
parameters (its v4 -> v5 MoE conversion, which also drops the module path), so the dense and shared-expert MLP
adapters cannot be expressed for ``PeftModel``: their export is refused (the merged export carries them).
"""

from __future__ import annotations

from torch import nn

from mmtrain.model.lora import add_lora_at
from mmtrain.models.contract import RoutedExpertsLayer
from mmtrain.models.deepseek_v3.config import DeepseekV3Config

# target -> (our linear in a layer, HF module path in a layer, HF names of its fused parts, where it exists)
TARGETS = {
    "q_down": ("attn.q_down", "self_attn.", ("q_a_proj",), "any"),
    "q_up": ("attn.q_up", "self_attn.", ("q_b_proj",), "any"),
    "q_proj": ("attn.q_proj", "self_attn.", ("q_proj",), "any"),
    "kv_down": ("attn.kv_down", "self_attn.", ("kv_a_proj_with_mqa",), "any"),
    "kv_up": ("attn.kv_up", "self_attn.", ("kv_b_proj",), "any"),
    "proj": ("attn.proj", "self_attn.", ("o_proj",), "any"),
    "up": ("mlp.up", "mlp.", ("gate_proj", "up_proj"), "dense"),
    "down": ("mlp.down", "mlp.", ("down_proj",), "dense"),
    "shared_up": ("mlp.shared.up", "mlp.shared_experts.", ("gate_proj", "up_proj"), "moe"),
    "shared_down": ("mlp.shared.down", "mlp.shared_experts.", ("down_proj",), "moe"),
}


def adapted_linears(cfg: DeepseekV3Config, targets, layers) -> list[tuple[int, str, str]]:
    """(layer, target, our linear's global path) of every adapted linear in ``layers`` (global indices)."""
    out = []
    for i in layers:
        for target in targets:
            linear, _, _, where = TARGETS[target]
            if where == "any" or (where == "moe") == cfg.is_moe_layer(i):
                out.append((i, target, f"layers.{i}.{linear}"))
    return out


def add_adapters(model: nn.Module, cfg: DeepseekV3Config, lora) -> list[str]:
    """Adapt ``model``'s (a stage's) linears of ``lora.targets`` (resolved by the caller); freeze the rest, the
    routing biases included (their balancing is off: an adapter applies to the base it was trained on)."""
    for module in model.modules():
        if isinstance(module, RoutedExpertsLayer):
            module.bias_update_rate = 0.0
    start, end = model.layer_range
    return add_lora_at(model, [path for _, _, path in adapted_linears(cfg, lora.targets, range(start, end))],
                       lora.rank, lora.alpha, lora.dora)
