"""GPT-OSS LoRA adapters on full tensors: merged into the base weights, or as a ``peft`` adapter with
``GptOssForCausalLM``'s module names.

The targets are the attention's linears (``qkv``, ``proj``; ``GPT_OSS_LORA_TARGETS``): the experts are fused 3-D
parameters in transformers, which ``peft``'s LoRA does not adapt. Our fused ``attn.qkv`` carries one adapter, one
``A`` (r x d) and one ``B`` ((q + k + v) x r); in HF terms that is ``q_proj``, ``k_proj`` and ``v_proj`` each with
the same ``A`` and its rows of ``B``, the same update, so ``PeftModel`` on the HF base computes what the adapted
model does (the biases are not adapted: ``bias: none``). DoRA magnitudes are per output feature: each HF module
keeps its rows of ours.
"""

from __future__ import annotations

import torch

from mmtrain.model.lora import merged_tensors, peft_adapter_form
from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.models.gpt_oss.spec import LORA_LINEARS

_HF_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",)}  # in a layer's self_attn


def _targets(cfg: GptOssConfig, lora) -> tuple[str, ...]:
    return tuple(lora.targets or cfg.lora_targets())


def _linears(cfg: GptOssConfig, lora):
    for i in range(cfg.num_layers):
        for target in _targets(cfg, lora):
            yield i, target, f"layers.{i}.{LORA_LINEARS[target]}"


def merge_lora(full: dict[str, torch.Tensor], cfg: GptOssConfig, lora) -> dict[str, torch.Tensor]:
    """The base model's tensors with every adapter merged in (``W + alpha/r * B A``, re-normalized for DoRA); no
    adapter tensors left."""
    return merged_tensors(full, [linear for _, _, linear in _linears(cfg, lora)], lora.alpha / lora.rank)


def peft_adapter(full: dict[str, torch.Tensor], cfg: GptOssConfig, lora,
                 base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under peft's saved names) of the adapters in ``full``."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    modules = []
    for i, target, linear in _linears(cfg, lora):
        rows = [q, kv, kv] if target == "qkv" else [full[f"{linear}.adapter.lora_B.weight"].shape[0]]
        modules.append((linear, [(f"model.layers.{i}.self_attn.{name}", n)
                                 for name, n in zip(_HF_MODULES[target], rows)]))
    return peft_adapter_form(full, modules, lora, base_model)
