"""Nemotron-H LoRA adapters on full tensors: merged into the base weights, or a ``peft`` adapter with
``NemotronHForCausalLM``'s module names.

Every target but ``qkv`` is one HF linear inside the layer's ``mixer`` (``in_proj``, ``out_proj``, ``o_proj``,
``up_proj``, ``down_proj``; the Mamba ``in_proj`` is fused [z | x | B | C | dt] on both sides). The fused ``qkv``
stands for ``q_proj`` / ``k_proj`` / ``v_proj``, each with the same ``A`` and its rows of ``B``
(``mmtrain.model.lora.peft_adapter_form``). peft refuses adapters on a Mamba layer's ``out_proj`` (mamba-ssm's fused
kernel computes it inside the scan), so that target exports merged only.
"""

from __future__ import annotations

import torch

from mmtrain.model.lora import merged_tensors, peft_adapter_form
from mmtrain.models.nemotron_h.config import LORA_LINEARS, NemotronHConfig
from mmtrain.models.nemotron_h.hf_adapter import HFAdapterError

_HF_MODULES = {"in_proj": ("in_proj",), "out_proj": ("out_proj",), "qkv": ("q_proj", "k_proj", "v_proj"),
               "proj": ("o_proj",), "up": ("up_proj",), "down": ("down_proj",)}


def _adapted(cfg: NemotronHConfig, lora):
    """(layer, target, our linear's global path) of every adapter (``lora.targets`` resolved): a target adapts
    the layers of its kind only."""
    for i, kind in enumerate(cfg.layer_kinds()):
        for target in lora.targets:
            target_kind, linear = LORA_LINEARS[target]
            if target_kind == kind:
                yield i, target, f"layers.{i}.{linear}"


def merge_lora(full: dict[str, torch.Tensor], cfg: NemotronHConfig, lora) -> dict[str, torch.Tensor]:
    """The base model's tensors with every adapter merged in (``W + alpha/r * B A``, re-normalized for DoRA); no
    adapter tensors left."""
    return merged_tensors(full, [linear for _, _, linear in _adapted(cfg, lora)], lora.alpha / lora.rank)


def peft_adapter(full: dict[str, torch.Tensor], cfg: NemotronHConfig, lora,
                 base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under peft's saved names) of the adapters in ``full``;
    ``HFAdapterError`` for an ``out_proj`` adapter, which peft does not load on a Mamba model."""
    if "out_proj" in lora.targets:
        raise HFAdapterError("peft.lora.targets out_proj: peft refuses LoRA on a Mamba layer's out_proj (mamba-ssm's "
                             "fused kernel computes it), so it has no peft adapter form; export the merged model "
                             "(--lora merge) or train without the out_proj target")
    kv = cfg.num_key_value_heads * cfg.head_dim
    qkv_rows = [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    modules = []
    for i, target, linear in _adapted(cfg, lora):
        rows = qkv_rows if target == "qkv" else [full[f"{linear}.adapter.lora_B.weight"].shape[0]]
        modules.append((linear, [(f"model.layers.{i}.mixer.{name}", n) for name, n in zip(_HF_MODULES[target], rows)]))
    return peft_adapter_form(full, modules, lora, base_model)
