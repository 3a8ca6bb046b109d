"""Random-token samples for benchmarks and smoke tests, deterministic per global sample index."""

from __future__ import annotations

import torch


class MockGPTSamples:
    """``sample(i)`` -> int64 tensor of ``seq_length + 1`` tokens, the same for index i on every rank."""

    eod_id = 0  # token 0 plays end-of-document, so packed-document options work on mock data too

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0) -> None:
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
