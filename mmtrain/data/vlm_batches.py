"""VLM micro-batches: rows of media samples (energon shards, or synthetic ones) and text-only samples (indexed
``.bin/.idx`` datasets) mixed by weight into the same ``MediaBatch``-es; text rows carry zero images.

Global row ``n`` (rows are numbered over all data-parallel ranks, as ``MicroBatches`` numbers samples) is a text
row when ``floor((n + 1) * f) > floor(n * f)`` for the text fraction ``f``, so after any ``n`` rows exactly
``floor(n * f)`` were text: the mix is exact and the same for every layout. Text row ``n`` is text sample
``floor(n * f)`` of the GPT samples; a media row is media sample ``m = n - floor(n * f)``: for ``data.mock`` a
synthetic one, else micro-batch ``m`` of the multimodal loader's global order (``mmtrain.data.multimodal_slices``).

Rows ``C .. C + dp * mbs - 1`` (``C``: rows consumed) form one round, a micro-batch for each rank. Mock rows are
dealt out in blocks (rank ``r`` takes rows ``C + r * mbs ..``). Energon rows come from streams: rank ``r`` reads
only media samples ``m = B + r (mod dp)`` (``B``: media samples consumed when the loader started), so a round's
media rows go to the ranks by that rule and its text rows fill the places left, in rank order. Every rank thus
reads its own slices only, and the samples of each step are those of one process's run at any layout.
State: the global row count plus the whole multimodal loader state (gathered over the data-parallel ranks at
save: a resume at another data-parallel or context-parallel size continues it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmtrain.data.media_batch import IGNORE_INDEX, MediaBatch, concat_rows, text_rows


_NOISE_IMAGES = 8  # distinct noise fields of the synthetic images
_STATE_VERSION = 2  # 2: the energon part is the whole (gathered) loader state, media rows dealt by stream


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
        # noise drawn once and picked per row: drawing a 448 px image's noise per row cost ~10 ms of host time
        # in the training loop's step (the GPU waited; issue #32's VLM row)
        self.noise = 0.1 * torch.randn(_NOISE_IMAGES, 3, image_size, image_size, generator=g)
        # (class, noise) -> the image, made on first use (at most num_classes x _NOISE_IMAGES: 154 MB at 448 px):
        # adding them per row cost ~7 ms of page faults on each fresh image, in the step's host time
        self._images: dict[tuple[int, int], torch.Tensor] = {}

    def row(self, i: int) -> MediaBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        c = int(torch.randint(len(self.captions), (1,), generator=g))
        s = self.image_size
        k = int(torch.randint(_NOISE_IMAGES, (1,), generator=g))
        if (c, k) not in self._images:
            self._images[c, k] = self.colours[c].expand(3, s, s) + self.noise[k]
        image = self._images[c, k]  # shared: rows are only read (``concat_rows`` copies them)
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

    @property
    def stream(self) -> bool:
        """True for the training loader: an endless stream in which this rank reads its own samples."""
        return self.loader.training

    @property
    def start(self) -> int:
        """Media samples all ranks had consumed when the stream started (0, or the loaded state's)."""
        return self.loader.first_micro_batch

    def state_dict(self, consumed: int | None = None) -> dict:
        """The whole multimodal loader state (plain JSON values) once ``consumed`` media samples are consumed
        (None: as many as this rank's count implies): collective over the data-parallel group."""
        return self.loader.global_state_dict(consumed) if self.loader.training else {}

    def load_state_dict(self, state: dict) -> None:
        if self.loader.training and state:
            self.loader.load_state_dict(state)


class VLMBatches:
    """``next()``: this data-parallel rank's next ``MediaBatch`` of ``micro_batch_size`` rows; see the module doc.
    ``media`` is a ``MockMediaSamples`` (indexed globally) or ``EnergonRows`` (this rank's stream) or None (text
    only); ``text`` a sequence of ``seq_length + 1``-token samples or None; ``text_fraction`` the share of text."""

    def __init__(self, media, text, text_fraction: float, micro_batch_size: int, dp_rank: int, dp_size: int,
                 image_size: int, text_row_inputs=None, pin: bool = False) -> None:
        if not 0.0 <= text_fraction <= 1.0:
            raise ValueError(f"text fraction {text_fraction} is not in [0, 1]")
        if (media is None and text_fraction < 1.0) or (text is None and text_fraction > 0.0):
            raise ValueError("VLMBatches: the text fraction does not match the sources given")
        self.media, self.text, self.text_fraction = media, text, text_fraction
        self.mbs, self.dp_rank, self.dp_size, self.image_size = micro_batch_size, dp_rank, dp_size, image_size
        self.text_row_inputs = text_row_inputs  # tokens (B, S+1) -> (positions, doc_ids, loss_mask) or None
        self.pin = pin  # batches in pinned host memory (a CUDA run)
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

    def _is_text(self, n: int) -> bool:
        return self._texts_before(n + 1) > self._texts_before(n)

    def _my_rows(self, first: int) -> list[int]:
        """The global rows of the round starting at row ``first`` that this rank takes (see the module doc)."""
        rows = range(first, first + self.mbs * self.dp_size)
        if not (isinstance(self.media, EnergonRows) and self.media.stream) or self.dp_size == 1:
            start = first + self.dp_rank * self.mbs
            return list(range(start, start + self.mbs))
        rank_of: dict[int, int] = {}
        room = [self.mbs] * self.dp_size
        for n in rows:  # media rows to the rank whose stream holds their sample
            if not self._is_text(n):
                rank_of[n] = (n - self._texts_before(n) - self.media.start) % self.dp_size
                room[rank_of[n]] -= 1
        q = 0
        for n in rows:  # text rows fill the places left, rank by rank
            if n not in rank_of:
                while room[q] == 0:
                    q += 1
                rank_of[n] = q
                room[q] -= 1
        return [n for n in rows if rank_of[n] == self.dp_rank]

    def next(self) -> MediaBatch:
        mine = self._my_rows(self.consumed_rows)
        self.consumed_rows += self.mbs * self.dp_size
        return concat_rows([self._row(n) for n in mine], self.pin)

    def state_dict(self) -> dict[str, Any]:
        """The global row count and (energon media) the whole multimodal loader state: collective over the
        data-parallel group, the same on every rank."""
        state: dict[str, Any] = {"consumed_rows": self.consumed_rows}
        if isinstance(self.media, EnergonRows):
            state["version"] = _STATE_VERSION
            state["energon"] = self.media.state_dict(self.consumed_rows - self._texts_before(self.consumed_rows))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s state, at any data-parallel size (``ValueError`` on a state that does
        not fit: one line naming what differs)."""
        rows = state.get("consumed_rows") if isinstance(state, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"the VLM loader state's 'consumed_rows' is {rows!r}, not a row count; the state is "
                             "damaged -- resume from an earlier checkpoint")
        if isinstance(self.media, EnergonRows) and self.media.stream and "energon" in state:
            media_rows = rows - self._texts_before(rows)
            energon = state["energon"]
            if state.get("version") != _STATE_VERSION:  # one rank's part, its stream's own count (older versions)
                if self.text_fraction > 0.0 and self.dp_size > 1:
                    raise ValueError("the VLM loader state was saved by an older mmtrain, whose ranks mixed text and "
                                     "media rows in another order; resume it with that version, or start from its "
                                     "weights with init_from")
            elif not isinstance(energon, dict) or energon.get("consumed_micro_batches") != media_rows:
                got = energon.get("consumed_micro_batches") if isinstance(energon, dict) else energon
                raise ValueError(f"the VLM loader state has {rows} rows consumed, {media_rows} of them media, but its "
                                 f"multimodal loader state has {got!r}; the state is inconsistent")
            self.media.load_state_dict(energon)
        self.consumed_rows = rows
