"""Encoder features -> language-model width: optional pixel shuffle, LayerNorm, then an MLP.

Pixel shuffle (InternVL/Idefics3 style) trades sequence length for width: each ``f x f`` block of neighbouring
patches becomes one token with ``f^2`` times the features, so an image costs ``f^2`` times fewer LM tokens.
Projectors are small and stay replicated over tensor-parallel ranks (their gradients are equal on every TP rank:
their outputs enter the LM through a copy-to-group / sequence split whose backward sums the TP contributions).
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config.vlm_schema import ProjectorConfig


def pixel_shuffle(x_NPD: torch.Tensor, factor: int) -> torch.Tensor:
    """(N, g*g, D) patches in row-major grid order -> (N, (g/f)^2, D*f^2): token (i, j) of the coarse grid holds
    the f x f patches (f*i + a, f*j + b), concatenated in (a, b) row-major order."""
    if factor == 1:
        return x_NPD
    n, p, d = x_NPD.shape
    g = math.isqrt(p)
    if g * g != p or g % factor:
        raise ValueError(f"pixel shuffle: a {p}-patch grid is not square with a side divisible by {factor}")
    x = x_NPD.view(n, g // factor, factor, g // factor, factor, d)  # (n, i, a, j, b, d)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, (g // factor) ** 2, factor * factor * d)


class Projector(nn.Module):
    """(N, T, in_dim) encoder features -> (N, T / shuffle^2, out_dim) language-model embeddings."""

    def __init__(self, cfg: ProjectorConfig, in_dim: int, out_dim: int, shuffle: int = 1) -> None:
        super().__init__()
        self.shuffle = shuffle
        width = in_dim * shuffle * shuffle
        hidden = cfg.hidden_size or out_dim
        self.norm = nn.LayerNorm(width) if cfg.input_norm else None
        dims = [width] + [hidden] * (cfg.num_layers - 1) + [out_dim]
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(dims))

    def forward(self, x_NTD: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(x_NTD, self.shuffle)
        if self.norm is not None:
            x = self.norm(x)
        for i, fc in enumerate(self.fc):
            x = fc(x)
            if i < len(self.fc) - 1:
                x = F.gelu(x)
        return x
