"""AdamW with weight-decay groups: matrices decay; norms, biases and other 1-D parameters do not."""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.config.schema import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    on_gpu = any(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=on_gpu or None)
