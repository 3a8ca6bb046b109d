"""The dense feed-forward block (fused gate|up projection) and its activation, for one device.

Shared by the transformer block (``mmtrain.model.layers``) and the mixture of experts (``mmtrain.model.moe``:
its experts use the same activation, its shared expert is this MLP), so neither imports the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.config.schema import ModelConfig


def swiglu_or_gelu(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU on ``h = [gate | up]`` when ``gated``, else tanh-approximated GELU."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def activate(h: torch.Tensor, name: str) -> torch.Tensor:
    """The MLP activation ``name`` (``ModelConfig.activation``) on ``h`` (``[gate | up]`` for swiglu). The
    non-gated kinds are the ones pretrained encoders were trained with, so imported weights compute the same."""
    if name in ("swiglu", "gelu"):
        return swiglu_or_gelu(h, name == "swiglu")
    if name == "gelu_erf":
        return F.gelu(h)
    if name == "quick_gelu":
        return h * torch.sigmoid(1.702 * h)
    raise ValueError(f"unknown MLP activation {name!r}")


class MLP(nn.Module):
    """``down(act(up(x)))``; for SwiGLU ``up`` is one fused [gate | up] projection (``part_sizes`` tells the TP plan)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        self.activation = cfg.activation
        width = cfg.ffn_hidden_size * (2 if self.gated else 1)
        self.up = nn.Linear(cfg.hidden_size, width, bias=cfg.add_bias)
        if self.gated:
            self.up.part_sizes = (cfg.ffn_hidden_size, cfg.ffn_hidden_size)  # [gate | up]
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias)

        self.recompute_activation = False  # selective recomputation: keep `up`'s output, not the activation's

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        return activate(h, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.recompute_activation and torch.is_grad_enabled():
            h = checkpoint(self._activation, h, use_reentrant=False)
        else:
            h = self._activation(h)
        return self.down(h)
