"""Per-data-parallel-rank micro-batches from one deterministic global order, resumable.

Global sample ``i`` is consumed in order. Micro-batch ``m`` of a step covers ``mbs * dp`` consecutive global
samples and data-parallel rank ``r`` takes the slice ``[r * mbs, (r + 1) * mbs)`` of it. The only state is
``consumed_samples`` (global), so a resumed run — even at another data-parallel size — continues the same order.
With a ``DocumentRule`` (packed documents) each micro-batch comes with its position ids, document ids and loss
mask (``GPTMicroBatch``), made here on the host so the train loop only moves them to the device.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmtrain.data.documents import DocumentRule, GPTMicroBatch


class MicroBatches:
    """``next()`` gives this data-parallel rank's next micro-batch; ``state_dict()`` resumes the global order.
    ``documents``: how samples are cut into packed documents (then ``next()`` gives ``GPTMicroBatch``es)."""

    def __init__(self, samples: Sequence[torch.Tensor], micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, documents: DocumentRule | None = None) -> None:
        self.samples = samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.documents = documents

    def next(self) -> torch.Tensor | GPTMicroBatch:
        """The next micro-batch of this rank: (mbs, seq_length + 1) int64 tokens, or with a ``DocumentRule`` a
        ``GPTMicroBatch`` of those tokens with their positions, document ids and loss mask."""
        tokens = self._next_tokens()
        return tokens if self.documents is None else self.documents.apply(tokens)

    def _next_tokens(self) -> torch.Tensor:
        start = self.consumed_samples + self.dp_rank * self.mbs
        self.consumed_samples += self.mbs * self.dp_size
        if self.consumed_samples > len(self.samples):
            raise StopIteration(f"the dataset has {len(self.samples)} samples; "
                                f"training asked for sample {self.consumed_samples - 1}")
        return torch.stack([torch.as_tensor(self.samples[i], dtype=torch.int64) for i in range(start, start + self.mbs)])

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
