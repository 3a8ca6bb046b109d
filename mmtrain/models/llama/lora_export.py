"""LoRA adapters of a Llama-family model on full tensors: merged into the base weights, or as a ``peft`` adapter
(``adapter_config.json`` + ``adapter_model.safetensors`` with Hugging Face module names).

Our fused linears carry one adapter: ``attn.qkv`` has one ``A`` (r x d) and one ``B`` ((q + k + v) x r). In HF
terms that is ``q_proj``, ``k_proj`` and ``v_proj`` each with the same ``A`` and its rows of ``B`` -- exactly
the same update ``B_q A x``, so ``peft``'s ``PeftModel`` on the HF base computes what the adapted model does.
Likewise ``mlp.up`` = ``gate_proj`` | ``up_proj``. DoRA's row norms are per output feature, so each HF module's
rows keep theirs: its magnitude vector is its rows of ours.
"""

from __future__ import annotations

import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.model.lora import merged_tensors, peft_adapter_form

# our target -> (our linear in a block, HF module path in a layer, HF module names of its fused parts)
_TARGETS = {"qkv": ("attn.qkv", "self_attn.", ("q_proj", "k_proj", "v_proj")),
            "proj": ("attn.proj", "self_attn.", ("o_proj",)),
            "up": ("mlp.up", "mlp.", ("gate_proj", "up_proj")),
            "down": ("mlp.down", "mlp.", ("down_proj",))}


def _part_sizes(cfg: ModelConfig, target: str) -> list[int] | None:
    hd = cfg.attention_head_dim
    if target == "qkv":
        return [cfg.num_attention_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]
    if target == "up":
        return [cfg.ffn_hidden_size] * 2 if cfg.activation == "swiglu" else None
    return None


def _pairs(full: dict[str, torch.Tensor], cfg: ModelConfig, lora):
    for i in range(cfg.num_layers):
        for target in lora.targets_for(cfg):
            linear = f"layers.{i}.{_TARGETS[target][0]}"
            yield i, target, linear, full[f"{linear}.adapter.lora_A.weight"], full[f"{linear}.adapter.lora_B.weight"]


def merge_lora(full: dict[str, torch.Tensor], cfg: ModelConfig, lora) -> dict[str, torch.Tensor]:
    """The base model's tensors with every adapter merged in (``W + alpha/r * B A``, re-normalized for DoRA); no
    adapter tensors left."""
    return merged_tensors(full, [linear for _, _, linear, _, _ in _pairs(full, cfg, lora)], lora.alpha / lora.rank)


def peft_adapter(full: dict[str, torch.Tensor], cfg: ModelConfig, lora,
                 base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under peft's saved names) of the adapters in ``full`` (DoRA: with
    ``use_dora`` and each module's ``lora_magnitude_vector``, the key peft 0.21 saves)."""
    modules = []
    for i, target, linear, _, b in _pairs(full, cfg, lora):
        _, where, hf_names = _TARGETS[target]
        rows = _part_sizes(cfg, target) or [b.shape[0]]
        modules.append((linear, [(f"model.layers.{i}.{where}{name}", n) for name, n in zip(hf_names, rows)]))
    return peft_adapter_form(full, modules, lora, base_model)
