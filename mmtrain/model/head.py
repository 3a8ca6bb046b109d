"""The output head of a language model as a small strategy object: output layer, per-token loss, full logits.

``LossHead`` is the one-device head. A model takes one at construction (``GPTModel(..., head=...)``); the TP
plan gives a vocab-sharded model ``mmtrain.parallel.tensor.VocabParallelHead`` (same methods: its input is
copied or gathered over TP, the loss is the vocab-parallel cross-entropy, full logits are gathered). ``matmul``
is ``F.linear``'s stand-in for the output layer when set (an FP8 matmul, ``mmtrain.model.fp8``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Per-token loss (B, S) in fp32."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="none").view_as(labels_BS)


class LossHead(nn.Module):
    """Output layer and loss on one device. ``compile_loss()`` compiles the cross-entropy (fuses the fp32
    upcast, log-softmax and its backward)."""

    def __init__(self, matmul: nn.Module | None = None) -> None:
        super().__init__()
        self.matmul = matmul
        self._loss = token_cross_entropy

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized hidden states as the output layer takes them."""
        return x

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if self.matmul is None else self.matmul(x, weight)

    def loss(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return self._loss(logits, labels_BS)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (what ``forward`` returns without labels)."""
        return logits

    def compile_loss(self) -> None:
        self._loss = torch.compile(token_cross_entropy)
