"""LoRA adapters: a linear ``y = W x + b`` becomes ``y = W x + b + (alpha / r) * B (A x)`` with a trainable rank-``r``
pair (``A``: r x in, ``B``: out x r) and ``W``, ``b`` frozen (Hu et al. 2021, as ``peft`` defines it).

DoRA (``peft.lora.dora``; Liu et al. 2024, as ``peft``'s ``use_dora``): the adapted weight is also re-normalized
per output feature, ``W' = m * (W + s B A) / ||W + s B A||_row`` (``s = alpha / r``, the norm over the input
dimension, treated as a constant in the backward as the paper and ``peft`` do), with a trained magnitude vector
``m`` that starts at the row norms of ``W`` (so the adapted model starts equal to its base).

The adapter is a small strategy module a linear carries as ``adapter`` and applies to the same input: the
one-device :class:`LoRALinear` here, and under TP the column/row-parallel (and TP-region entry) linears of
``mmtrain.parallel.tensor``, which keep the adapter of the linear they replace. The linear adds ``adapter(x)`` to
its output; a DoRA adapter (``needs_base``) is called as ``adapter(x, base, weight, input_group)`` (``base``: the
linear's output without bias, ``weight``: its weight as this rank holds it, ``input_group``: the TP group its input
dimension is split over, or None; the linear says which as ``input_split_group``), before the bias is added. The
adapter's two linears are ordinary ``nn.Linear`` modules the TP plan shards as the family's sharding spec says
(``mmtrain.models.spec.lora_adapter_entries``): for a column linear ``B`` is column-split like the weight (whole
fused parts) and ``A`` whole; for a row linear ``A`` is row-split like the weight and ``B`` whole; a replicated
linear's adapter stays whole. DoRA's magnitude is split like the output features (column linears) or whole; a
row linear's squared row norms are summed over ``input_group``. Parameter names: ``<linear>.adapter.lora_A.weight``
/ ``lora_B.weight`` (and ``<linear>.adapter.magnitude``) next to ``<linear>.weight``, so the base names
(checkpoints, the HF bridge) are unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _dora_gain(magnitude: torch.Tensor, row_norm: torch.Tensor) -> torch.Tensor:
    """``m / ||W + scale B A||_row`` in fp32 at least, the norm rounded to the magnitude's dtype first: a bf16
    magnitude set from that norm (:func:`reset_dora_magnitudes`) then gives exactly 1, the base model."""
    t = _at_least_fp32(magnitude.dtype)
    return magnitude.to(t) / row_norm.to(magnitude.dtype).to(t)


class LoRAAdapter(nn.Module):
    """``scale * B(A(x))``; ``B`` starts at zero, so an adapted model starts equal to its base."""

    needs_base = False  # the linear adds ``adapter(x)`` to its output (with bias); True: DoRA's call, before the bias

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor, base: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                input_group=None) -> torch.Tensor:
        return self.lora_B(self.lora_A(x)) * self.scale


class DoRAAdapter(LoRAAdapter):
    """DoRA: ``(m / n - 1) * W x + (m / n) * scale * B(A(x))`` added to ``W x + b``, i.e. ``(m / n)(W + scale B A) x
    + b`` with ``n = ||W + scale B A||_row`` (no gradient through ``n``). ``magnitude`` (``m``, one per output
    feature this rank holds) is set by :func:`reset_dora_magnitudes` once the weight it belongs to is known."""

    needs_base = True

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__(in_features, out_features, rank, alpha)
        self.magnitude = nn.Parameter(torch.ones(out_features))

    @torch.no_grad()
    def weight_norm(self, weight: torch.Tensor, input_group=None) -> torch.Tensor:
        """``||W + scale B A||`` per output row (in fp32 at least), the squares summed over ``input_group`` when
        the input dimension is split over it (a row-parallel linear)."""
        t = _at_least_fp32(weight.dtype)
        sq = (weight.to(t) + self.scale * (self.lora_B.weight.to(t) @ self.lora_A.weight.to(t))).square().sum(1)
        if input_group is not None and dist.get_world_size(input_group) > 1:
            dist.all_reduce(sq, group=input_group)
        return sq.sqrt()

    def forward(self, x: torch.Tensor, base: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                input_group=None) -> torch.Tensor:
        gain = _dora_gain(self.magnitude, self.weight_norm(weight, input_group))
        lora = self.lora_B(self.lora_A(x)) * self.scale
        return (gain - 1).to(base.dtype) * base + gain.to(lora.dtype) * lora

    @torch.no_grad()
    def reset_magnitude(self, weight: torch.Tensor, input_group=None) -> None:
        """``m = ||W + scale B A||_row``: the adapter then leaves its linear's output as the plain LoRA one."""
        self.magnitude.copy_(self.weight_norm(weight, input_group))


class LoRALinear(nn.Linear):
    """A linear with an adapter on its input; shares the base linear's weight and bias parameters."""

    input_split_group = None  # one device: the input dimension is whole

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dora: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        if hasattr(base, "part_sizes"):
            self.part_sizes = base.part_sizes
        self.adapter = (DoRAAdapter if dora else LoRAAdapter)(base.in_features, base.out_features, rank, alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is None or not self.adapter.needs_base:  # plain LoRA, or merged (merge_adapters)
            y = F.linear(x, self.weight, self.bias)
            return y if self.adapter is None else y + self.adapter(x)
        y = F.linear(x, self.weight)
        y = y + self.adapter(x, y, self.weight, None)
        return y + self.bias if self.bias is not None else y


def add_lora(module: nn.Module, targets: list[str], rank: int, alpha: float, dora: bool = False) -> list[str]:
    """Replace every ``nn.Linear`` of ``module`` whose local name (the last part of its path) is in ``targets``
    by a :class:`LoRALinear` (``dora``: with a DoRA adapter); freeze all of ``module``'s other parameters.
    Returns the adapted paths."""
    chosen = [name for name, m in module.named_modules()
              if type(m) is nn.Linear and name.rpartition(".")[2] in targets]
    return add_lora_at(module, chosen, rank, alpha, dora)


def add_lora_at(module: nn.Module, paths: list[str], rank: int, alpha: float, dora: bool = False) -> list[str]:
    """Replace the ``nn.Linear`` at each of ``paths`` (module paths inside ``module``; a family chooses them from
    its own names) by a :class:`LoRALinear` (``dora``: with a DoRA adapter); freeze all of ``module``'s other
    parameters. Returns ``paths``."""
    linears = [(name, module.get_submodule(name)) for name in paths]
    for name, m in linears:
        if type(m) is not nn.Linear:
            raise TypeError(f"{name}: LoRA adapts plain nn.Linear modules, not {type(m).__name__}")
    for p in module.parameters():
        p.requires_grad_(False)
    for name, linear in linears:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, LoRALinear(linear, rank, alpha, dora))
    return list(paths)


def _dora_linears(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(getattr(module, "adapter", None), DoRAAdapter):
            yield name, module


@torch.no_grad()
def reset_dora_magnitudes(model: nn.Module) -> list[str]:
    """Set every DoRA magnitude of ``model`` to its linear's current row norms (``||W + scale B A||``, summed
    over TP for row-parallel shards): after the base weights are initialized or loaded, so the adapted model
    starts equal to the base (``B`` at zero). Returns the linears' names."""
    names = []
    for name, module in _dora_linears(model):
        module.adapter.reset_magnitude(module.weight, getattr(module, "input_split_group", None))
        names.append(name)
    return names


@torch.no_grad()
def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
                  magnitude: torch.Tensor | None = None, row_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``W + scale * B A`` on full tensors (computed in fp32 at least, returned in the weight's dtype); with a DoRA
    ``magnitude``, ``magnitude / ||W + scale B A||_row * (W + scale B A)`` (``row_norm``: that norm when the rows
    are split, e.g. a row-parallel shard's, summed over TP; default this tensor's own)."""
    t = _at_least_fp32(weight.dtype)
    w = weight.to(t) + scale * (lora_B.to(t) @ lora_A.to(t))
    if magnitude is not None:
        w = w * _dora_gain(magnitude, w.norm(dim=1) if row_norm is None else row_norm).to(t)[:, None]
    return w.to(weight.dtype)


@torch.no_grad()
def merged_tensors(full: dict[str, torch.Tensor], linears: list[str], scale: float) -> dict[str, torch.Tensor]:
    """Full tensors of an adapted model (``full``, adapter tensors at ``LINEAR.adapter.lora_A/B.weight`` and for
    DoRA ``LINEAR.adapter.magnitude``) as the base model's, each of ``linears`` holding its merged weight
    (``merged_weight``); no adapter tensors left (the merged export)."""
    out = {k: v for k, v in full.items() if ".adapter." not in k}
    for linear in linears:
        out[f"{linear}.weight"] = merged_weight(full[f"{linear}.weight"], full[f"{linear}.adapter.lora_A.weight"],
                                                full[f"{linear}.adapter.lora_B.weight"], scale,
                                                full.get(f"{linear}.adapter.magnitude"))
    return out


def peft_adapter_form(full: dict[str, torch.Tensor], modules, lora,
                      base_model: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json mapping, tensors under ``peft``'s saved names) of the adapters in ``full``.
    ``modules``: per adapted linear of ours, (its global path, [(HF module path, its output rows), ...]): a fused
    linear stands for several HF modules, each with the same ``A`` and its rows of ``B`` (the same update, so
    ``PeftModel`` on the HF base computes what the adapted model does), and DoRA magnitudes split like ``B``'s
    rows (with ``use_dora`` and each module's ``lora_magnitude_vector``, the key peft 0.21 saves).
    ``target_modules``: the HF modules' last names."""
    tensors: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for linear, parts in modules:
        a, b = full[f"{linear}.adapter.lora_A.weight"], full[f"{linear}.adapter.lora_B.weight"]
        rows = [n for _, n in parts]
        magnitude = full.get(f"{linear}.adapter.magnitude")
        magnitudes = magnitude.split(rows) if magnitude is not None else [None] * len(parts)
        for (module, _), piece, m in zip(parts, b.split(rows), magnitudes):
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = a.clone()  # one copy per HF module (safetensors shares none)
            tensors[f"{key}.lora_B.weight"] = piece.contiguous()
            if m is not None:
                tensors[f"{key}.lora_magnitude_vector"] = m.contiguous()
            name = module.rpartition(".")[2]
            if name not in names:
                names.append(name)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": names,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": lora.dora, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
    return config, tensors


@torch.no_grad()
def merge_adapters(model: nn.Module) -> list[str]:
    """Fold every LoRA adapter of ``model`` into the weight of the linear carrying it (``W + alpha/r * B A``, or
    DoRA's re-normalized weight) and drop the adapter: the model then computes what the adapted one did at the
    base model's cost (for using a trained model: generation, evaluation; the adapters cannot train further).
    Works on tensor-parallel shards as they are: a column linear's ``B`` rows (and DoRA magnitudes) are split
    like its weight's rows and ``A`` is whole, a row linear's ``A`` columns like its weight's columns and ``B``
    is whole, so each rank's ``B A`` is its shard of the full update (a row linear's DoRA row norms are summed
    over its TP group). Returns the merged linears' names."""
    merged = []
    for name, module in model.named_modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, LoRAAdapter):
            dora = isinstance(adapter, DoRAAdapter)
            norm = adapter.weight_norm(module.weight, getattr(module, "input_split_group", None)) if dora else None
            module.weight.copy_(merged_weight(module.weight, adapter.lora_A.weight, adapter.lora_B.weight,
                                              adapter.scale, adapter.magnitude if dora else None, norm))
            module.adapter = None
            merged.append(name)
    return merged
