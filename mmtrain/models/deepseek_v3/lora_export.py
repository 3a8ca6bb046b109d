"""DeepSeek-V3 LoRA adapters on full tensors: merged into the base weights, or the attention adapters as a ``peft``
adapter with ``DeepseekV3ForCausalLM``'s module names (``mmtrain.models.deepseek_v3.lora`` has the targets; why
the MLP adapters have no peft form is said there)."""

from __future__ import annotations

import torch

from mmtrain.model.lora import merged_tensors
from mmtrain.models.deepseek_v3.config import DeepseekV3Config
from mmtrain.models.deepseek_v3.hf_adapter import HFAdapterError
from mmtrain.models.deepseek_v3.lora import TARGETS, adapted_linears

_MLP_TARGETS = ("up", "down", "shared_up", "shared_down")  # no peft adapter form


def _pairs(full: dict[str, torch.Tensor], cfg: DeepseekV3Config, lora):
    for i, target, linear in adapted_linears(cfg, lora.targets, range(cfg.num_layers)):
        yield i, target, linear, full[f"{linear}.adapter.lora_A.weight"], full[f"{linear}.adapter.lora_B.weight"]


def merge_lora(full: dict[str, torch.Tensor], cfg: DeepseekV3Config, lora) -> dict[str, torch.Tensor]:
    """The base model's tensors with every adapter merged in (``W + alpha/r * B A``, re-normalized for DoRA); no
    adapter tensors left."""
    return merged_tensors(full, [linear for _, _, linear, _, _ in _pairs(full, cfg, lora)], lora.alpha / lora.rank)


def peft_adapter(full: dict[str, torch.Tensor], cfg: DeepseekV3Config, lora,
                 base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under peft's saved names) of the attention adapters in ``full``
    (``HFAdapterError`` for MLP targets); ``target_modules`` is a regex of the full module paths."""
    mlp = [t for t in lora.targets if t in _MLP_TARGETS]
    if mlp:
        raise HFAdapterError(f"peft.lora.targets {', '.join(mlp)}: peft maps gate_proj/up_proj/down_proj of a "
                             "DeepseekV3 model onto its routed experts, so MLP adapters have no peft adapter form; "
                             "export the merged model (--lora merge) or train attention targets only")
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for i, target, linear, a, b in _pairs(full, cfg, lora):
        _, where, (name,), _ = TARGETS[target]  # attention: one HF module per linear
        module = f"model.layers.{i}.{where}{name}"
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        magnitude = full.get(f"{linear}.adapter.magnitude")
        if magnitude is not None:  # DoRA (the key peft 0.21 saves)
            tensors[f"base_model.model.{module}.lora_magnitude_vector"] = magnitude.contiguous()
        modules.append(module.replace(".", r"\."))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
              "target_modules": "^(" + "|".join(modules) + ")$",
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": lora.dora, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
    return config, tensors
