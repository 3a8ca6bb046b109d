"""VLM micro-batches: rows of media samples (energon shards, or synthetic ones) and text-only samples (indexed
``.bin/.idx`` datasets) mixed by weight into the same ``MediaBatch``-es; text rows carry zero images.

Global row ``n`` (rows are numbered over all data-parallel ranks, as ``MicroBatches`` numbers samples) is a text
row when ``floor((n + 1) * f) > floor(n * f)`` for the text fraction ``f``, so after any ``n`` rows exactly
``floor(n * f)`` were text: the mix is exact and the same for every layout. Text row ``n`` is text sample
``floor(n * f)`` of the GPT samples; a media row is the next sample of this rank's energon stream (energon shards
its data over the data-parallel ranks itself), or, for ``data.mock``, synthetic media sample ``n - floor(n * f)``.
State: the global row count plus this rank's part of the multimodal loader state (plain JSON values).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmtrain.data.media_batch import IGNORE_INDEX, MediaBatch, concat_rows, text_rows


class MockMediaSamples:
    """Synthetic image-caption samples, deterministic per index: the image is one of ``num_classes`` colour
    patterns (plus noise) and the caption a fixed token string per class, so a model can learn to caption them.
    ``[image placeholders] [caption]`` fills ``seq_length + 1`` tokens; labels are -100 on the placeholders."""

    def __init__(self, vocab_size: int, seq_length: int, image_token_id: int, num_image_tokens: int,
                 image_size: int, seed: int = 0, num_classes: int = 8, text_ids_below: int | None = None) -> None:
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.image_token_id, self.num_image_tokens, self.image_size = image_token_id, num_image_tokens, image_size
        g = torch.Generator().manual_seed(seed)
        n_text = seq_length + 1 - num_image_tokens
        # caption ids stay below the placeholder ids (which sit at the top of the vocabulary in our configs)
        high = text_ids_below or (image_token_id if 1 < image_token_id < vocab_size else vocab_size)
        self.captions = torch.randint(1, high, (num_classes, n_text), generator=g)
        self.colours = torch.rand(num_classes, 3, 1, 1, generator=g) * 2 - 1

    def row(self, i: int) -> MediaBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        c = int(torch.randint(len(self.captions), (1,), generator=g))
        s = self.image_size
        image = self.colours[c].expand(3, s, s) + 0.1 * torch.randn(3, s, s, generator=g)
        seq = torch.cat([torch.full((self.num_image_tokens,), self.image_token_id), self.captions[c]])
        labels = seq[1:].clone()
        labels[: self.num_image_tokens - 1] = IGNORE_INDEX
        S = self.seq_length
        return MediaBatch(
            tokens=seq[None, :-1], labels=labels[None], loss_mask=(labels != IGNORE_INDEX).float()[None],
            position_ids=torch.arange(S)[None], document_ids=torch.zeros(1, S, dtype=torch.int64),
            images=image[None], image_counts=torch.ones(1, dtype=torch.int64),
            frame_index=torch.zeros(1, dtype=torch.int64), audio=torch.zeros(0, 0),
            audio_lengths=torch.zeros(0, dtype=torch.int64), audio_counts=torch.zeros(1, dtype=torch.int64))


class EnergonRows:
    """One row at a time from a per-rank energon loader built with micro-batch size 1 (train: endless and
    resumable; valid: ordered passes, started again when one ends)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self._it = None

    def next(self) -> MediaBatch:
        if self.loader.training:
            return MediaBatch.of(next(self.loader))
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return MediaBatch.of(next(self._it))
            except StopIteration:
                self._it = None
        raise ValueError("the multimodal valid split has no samples; add valid shards (mmtrain-prep media "
                         "--val-ratio) or set train.eval_every=0")

    def state_dict(self) -> dict:
        """This rank's part of the multimodal loader state (plain JSON values)."""
        return self.loader.state_dict() if self.loader.training else {}

    def load_state_dict(self, state: dict) -> None:
        if self.loader.training and state:
            self.loader.load_state_dict(state)


class VLMBatches:
    """``next()``: this data-parallel rank's next ``MediaBatch`` of ``micro_batch_size`` rows; see the module doc.
    ``media`` is a ``MockMediaSamples`` (indexed globally) or ``EnergonRows`` (this rank's stream) or None (text
    only); ``text`` a sequence of ``seq_length + 1``-token samples or None; ``text_fraction`` the share of text."""

    def __init__(self, media, text, text_fraction: float, micro_batch_size: int, dp_rank: int, dp_size: int,
                 image_size: int, text_row_inputs=None) -> None:
        if not 0.0 <= text_fraction <= 1.0:
            raise ValueError(f"text fraction {text_fraction} is not in [0, 1]")
        if (media is None and text_fraction < 1.0) or (text is None and text_fraction > 0.0):
            raise ValueError("VLMBatches: the text fraction does not match the sources given")
        self.media, self.text, self.text_fraction = media, text, text_fraction
        self.mbs, self.dp_rank, self.dp_size, self.image_size = micro_batch_size, dp_rank, dp_size, image_size
        self.text_row_inputs = text_row_inputs  # tokens (B, S+1) -> (positions, doc_ids, loss_mask) or None
        self.consumed_rows = 0

    def _texts_before(self, n: int) -> int:
        return math.floor(n * self.text_fraction + 1e-9)

    def _row(self, n: int) -> MediaBatch:
        t = self._texts_before(n)
        if self._texts_before(n + 1) > t:
            tokens = torch.as_tensor(self.text[t], dtype=torch.int64)[None]
            extra = self.text_row_inputs(tokens) if self.text_row_inputs else (None, None, None)
            return text_rows(tokens, self.image_size, *extra)
        if isinstance(self.media, MockMediaSamples):
            return self.media.row(n - t)
        return self.media.next()

    def next(self) -> MediaBatch:
        start = self.consumed_rows + self.dp_rank * self.mbs
        self.consumed_rows += self.mbs * self.dp_size
        return concat_rows([self._row(n) for n in range(start, start + self.mbs)])

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"consumed_rows": self.consumed_rows}
        if isinstance(self.media, EnergonRows):
            state["energon"] = self.media.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_rows = int(state["consumed_rows"])
        if isinstance(self.media, EnergonRows) and "energon" in state:
            self.media.load_state_dict(state["energon"])
