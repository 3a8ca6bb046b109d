"""Learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant."""

from __future__ import annotations

import math

from mmtrain.config.schema import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based) of ``total_steps``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    final = cfg.final_lr()
    if cfg.schedule == "cosine":
        return final + 0.5 * (cfg.lr - final) * (1 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to the final lr over the last `decay_fraction` of the steps
    decay_start = 1.0 - cfg.decay_fraction
    if progress <= decay_start:
        return cfg.lr
    return cfg.lr + (final - cfg.lr) * (progress - decay_start) / max(cfg.decay_fraction, 1e-12)
