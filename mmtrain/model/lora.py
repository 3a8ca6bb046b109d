"""LoRA adapters: a linear ``y = W x + b`` becomes ``y = W x + b + (alpha / r) * B (A x)`` with a trainable rank-``r``
pair (``A``: r x in, ``B``: out x r) and ``W``, ``b`` frozen (Hu et al. 2021, as ``peft`` defines it).

The adapter is a small strategy module a linear carries as ``adapter`` and applies to the same input: the
one-device :class:`LoRALinear` here, and under TP the column/row-parallel (and TP-region entry) linears of
``mmtrain.parallel.tensor``, which keep the adapter of the linear they replace. Its two linears are ordinary
``nn.Linear`` modules the TP plan shards as the family's sharding spec says
(``mmtrain.models.spec.lora_adapter_entries``): for a column linear ``B`` is column-split like the weight (whole
fused parts) and ``A`` whole; for a row linear ``A`` is row-split like the weight and ``B`` whole; a replicated
linear's adapter stays whole. Parameter names: ``<linear>.adapter.lora_A.weight`` / ``lora_B.weight`` next to
``<linear>.weight``, so the base names (checkpoints, the HF bridge) are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoRAAdapter(nn.Module):
    """``scale * B(A(x))``; ``B`` starts at zero, so an adapted model starts equal to its base."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(x)) * self.scale


class LoRALinear(nn.Linear):
    """A linear with an adapter on its input; shares the base linear's weight and bias parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        if hasattr(base, "part_sizes"):
            self.part_sizes = base.part_sizes
        self.adapter = LoRAAdapter(base.in_features, base.out_features, rank, alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.adapter is None else y + self.adapter(x)  # None: merged (merge_adapters)


def add_lora(module: nn.Module, targets: list[str], rank: int, alpha: float) -> list[str]:
    """Replace every ``nn.Linear`` of ``module`` whose local name (the last part of its path) is in ``targets``
    by a :class:`LoRALinear`; freeze all of ``module``'s other parameters. Returns the adapted paths."""
    chosen = [name for name, m in module.named_modules()
              if type(m) is nn.Linear and name.rpartition(".")[2] in targets]
    return add_lora_at(module, chosen, rank, alpha)


def add_lora_at(module: nn.Module, paths: list[str], rank: int, alpha: float) -> list[str]:
    """Replace the ``nn.Linear`` at each of ``paths`` (module paths inside ``module``; a family chooses them from
    its own names) by a :class:`LoRALinear`; freeze all of ``module``'s other parameters. Returns ``paths``."""
    linears = [(name, module.get_submodule(name)) for name in paths]
    for name, m in linears:
        if type(m) is not nn.Linear:
            raise TypeError(f"{name}: LoRA adapts plain nn.Linear modules, not {type(m).__name__}")
    for p in module.parameters():
        p.requires_grad_(False)
    for name, linear in linears:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, LoRALinear(linear, rank, alpha))
    return list(paths)


@torch.no_grad()
def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A`` on full tensors (computed in fp32, returned in the weight's dtype)."""
    return (weight.float() + scale * (lora_B.float() @ lora_A.float())).to(weight.dtype)


@torch.no_grad()
def merged_tensors(full: dict[str, torch.Tensor], linears: list[str], scale: float) -> dict[str, torch.Tensor]:
    """Full tensors of an adapted model (``full``, adapter tensors at ``LINEAR.adapter.lora_A/B.weight``) as the
    base model's, each of ``linears`` holding ``W + scale * B A``; no adapter tensors left (the merged export)."""
    out = {k: v for k, v in full.items() if ".adapter." not in k}
    for linear in linears:
        out[f"{linear}.weight"] = merged_weight(full[f"{linear}.weight"], full[f"{linear}.adapter.lora_A.weight"],
                                                full[f"{linear}.adapter.lora_B.weight"], scale)
    return out


@torch.no_grad()
def merge_adapters(model: nn.Module) -> list[str]:
    """Fold every LoRA adapter of ``model`` into the weight of the linear carrying it (``W + alpha/r * B A``)
    and drop the adapter: the model then computes what the adapted one did at the base model's cost (for using
    a trained model: generation, evaluation; the adapters cannot train further). Works on tensor-parallel
    shards as they are: a column linear's ``B`` rows are split like its weight's rows and ``A`` is whole, a row
    linear's ``A`` columns like its weight's columns and ``B`` is whole, so each rank's ``B A`` is its shard of
    the full update. Returns the merged linears' names."""
    merged = []
    for name, module in model.named_modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, LoRAAdapter):
            module.weight.copy_(merged_weight(module.weight, adapter.lora_A.weight, adapter.lora_B.weight,
                                              adapter.scale))
            module.adapter = None
            merged.append(name)
    return merged
