"""Gemma 3 LoRA adapters on full tensors: merged into the base weights, or a ``peft`` adapter with
``Gemma3ForCausalLM``'s module names.

As in the Llama family, a fused linear carries one adapter: ``attn.qkv``'s ``A`` (r x d) and ``B`` ((q + k + v) x
r) are, in HF terms, ``q_proj`` / ``k_proj`` / ``v_proj`` each with the same ``A`` and its rows of ``B`` -- the same
update, so ``PeftModel`` on the HF base computes what the adapted model does. Likewise ``mlp.up`` = ``gate_proj``
| ``up_proj``. DoRA magnitudes are per output feature: each HF module keeps its rows of ours.
"""

from __future__ import annotations

import torch

from mmtrain.model.lora import merged_tensors, peft_adapter_form
from mmtrain.models.gemma3.config import Gemma3Config
from mmtrain.models.gemma3.spec import LORA_LINEARS

_HF_MODULES = {"qkv": ("self_attn.", ("q_proj", "k_proj", "v_proj")), "proj": ("self_attn.", ("o_proj",)),
               "up": ("mlp.", ("gate_proj", "up_proj")), "down": ("mlp.", ("down_proj",))}


def _part_sizes(cfg: Gemma3Config, target: str) -> list[int] | None:
    if target == "qkv":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size] * 2 if target == "up" else None


def _adapted(cfg: Gemma3Config, lora):
    """(layer, target, our linear's global path) of every adapter (``lora.targets`` resolved)."""
    for i in range(cfg.num_layers):
        for target in lora.targets:
            yield i, target, f"layers.{i}.{LORA_LINEARS[target]}"


def merge_lora(full: dict[str, torch.Tensor], cfg: Gemma3Config, lora) -> dict[str, torch.Tensor]:
    """The base model's tensors with every adapter merged in (``W + alpha/r * B A``, re-normalized for DoRA); no
    adapter tensors left."""
    return merged_tensors(full, [linear for _, _, linear in _adapted(cfg, lora)], lora.alpha / lora.rank)


def peft_adapter(full: dict[str, torch.Tensor], cfg: Gemma3Config, lora,
                 base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under peft's saved names) of the adapters in ``full`` (DoRA: with
    ``use_dora`` and each module's ``lora_magnitude_vector``)."""
    modules = []
    for i, target, linear in _adapted(cfg, lora):
        where, hf_names = _HF_MODULES[target]
        rows = _part_sizes(cfg, target) or [full[f"{linear}.adapter.lora_B.weight"].shape[0]]
        modules.append((linear, [(f"model.layers.{i}.{where}{name}", n) for name, n in zip(hf_names, rows)]))
    return peft_adapter_form(full, modules, lora, base_model)
