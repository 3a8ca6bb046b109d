"""The index arrays behind GPT samples and blends, built in numpy (no C++ build step).

A GPT dataset over documents ``D`` (one split's range of an indexed dataset) is three arrays, with the same
meaning and, for the same inputs and seed, the same values as Megatron-Core's ``GPTDataset``:

* document index: ``D`` repeated once per epoch, shuffled (int32). When the last epoch is used for less
  than 80% of its samples it is shuffled separately, so the partial epoch still sees a uniform document mix.
* sample index: ``(num_samples + 1, 2)`` int64 rows ``(position in document index, token offset)``; sample
  ``k`` runs from row ``k`` to row ``k + 1`` plus one extra token, so consecutive samples overlap by one
  token and every token (except the first) is a label exactly once per epoch.
* shuffle index: a permutation of the sample rows (again separate for a short last epoch).

The shuffles use ``numpy.random.RandomState(seed)`` in Megatron's order, which is what makes the arrays equal.

Blend indices assign each global sample to a dataset: ``dataset_index[n]`` and the sample number inside that
dataset, ``dataset_sample_index[n]``. They are built by an earliest-deadline rule (the quota method of
apportionment), which keeps every dataset's count after any ``n`` samples within 1 of ``n * weight``.

Why numpy and not numba for the sample index and the gather: numba's first call in a process costs ~1.5-2.5 s
(its typing machinery is imported and the cached machine code loaded) and every rank of every launch, evaluation
and export pays it; the vectorized sample index and the per-document slice copies are as fast at the sizes used.
The blend index is a sequential rule: a Python loop below ``_BLEND_NUMBA_FROM`` samples, numba above it.
"""

from __future__ import annotations

import functools

import numpy as np

# A final epoch used for less than this fraction of its samples gets its own shuffle (Megatron's threshold).
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


def num_epochs_for(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Epochs needed so that ``num_samples`` samples of ``seq_length + 1`` tokens (overlapping by one) fit."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, num_samples: int, seq_length: int, num_epochs: int) -> bool:
    if num_epochs == 1:
        return False
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - samples_before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch)


def num_indexed_samples(tokens_per_epoch: int, num_epochs: int, seq_length: int) -> int:
    """Samples in ``num_epochs`` whole epochs (the last partial sample is dropped)."""
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled; a separate last epoch shuffled on its own."""
    if separate_last and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(documents.astype(np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_shuffle_index(first_size: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, first_size)`` followed by one of ``[first_size, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(first_size, dtype=dtype)
    rng.shuffle(first)
    if first_size == total_size:
        return first
    last = np.arange(first_size, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       tokens_per_epoch: int, num_epochs: int) -> np.ndarray:
    """Start (document-index position, offset) of every sample that fits in ``num_epochs`` epochs, plus the
    end row. Lengths are int32 per sequence of the whole indexed dataset. int32 rows when positions fit
    (half the memory traffic and file size), else int64 -- Megatron's choice too."""
    num_samples = num_indexed_samples(tokens_per_epoch, num_epochs, seq_length)
    dtype = np.int32 if document_index.shape[0] < np.iinfo(np.int32).max else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    _fill_sample_index(np.asarray(lengths), np.asarray(document_index), seq_length, out)
    return out


_DOCS_PER_CHUNK = 1 << 22  # document-index positions per step: bounds the int64 work arrays (~32 MiB each)
_ROWS_PER_CHUNK = 1 << 22


def _fill_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_length: int, out: np.ndarray) -> None:
    """Row ``k`` starts at token ``k * seq_length`` of the epochs' token stream (documents in document-index
    order; each sample's last token is the next one's first): its row is the document holding that token and the
    token's offset in it. A token position at a document's end belongs to the next non-empty document."""
    num_rows = out.shape[0]
    out[0] = 0  # row 0 is (0, 0) even when the first document is empty (gather copies nothing from it)
    row = 1
    tokens_before = 0  # tokens of the documents before this chunk
    for lo in range(0, document_index.shape[0], _DOCS_PER_CHUNK):
        doc_lengths = lengths[document_index[lo:lo + _DOCS_PER_CHUNK]].astype(np.int64)
        ends = tokens_before + np.cumsum(doc_lengths)  # each document's end in the token stream (exclusive)
        # rows whose first token lies in this chunk: row * seq_length < ends[-1]
        last_row = min(num_rows - 1, (int(ends[-1]) - 1) // seq_length)
        while row <= last_row:
            rows = np.arange(row, min(last_row, row + _ROWS_PER_CHUNK - 1) + 1, dtype=np.int64)
            positions = rows * seq_length
            at = np.searchsorted(ends, positions, side="right")
            out[rows, 0] = lo + at
            out[rows, 1] = positions - (ends[at] - doc_lengths[at])
            row = int(rows[-1]) + 1
        tokens_before = int(ends[-1])
    if row < num_rows:  # past the last token (the sizes never ask for it): the last document's last token
        last = document_index.shape[0] - 1
        out[row:, 0] = last
        out[row:, 1] = lengths[document_index[last]] - 1


_BLEND_NUMBA_FROM = 1 << 16  # the Python loop takes ~0.2 s here on two datasets, below numba's start-up cost


def _fill_blend_index(weights, size):
    k = weights.shape[0]
    counts = np.zeros(k, dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for n in range(size):
        # Eligible: taking one more keeps the count at most n+1 samples' share + 1 (upper quota). Among them
        # the most urgent is the one whose count would first fall a whole sample behind its share.
        best = -1
        best_key = np.inf
        for i in range(k):
            if counts[i] < (n + 1) * weights[i] + 1e-9:
                key = (counts[i] + 1) / weights[i]
                if key < best_key:
                    best_key = key
                    best = i
        if best < 0:  # cannot happen in exact arithmetic (some count is below its share); guard rounding
            for i in range(k):
                key = (counts[i] + 1) / weights[i]
                if best < 0 or key < best_key:
                    best_key = key
                    best = i
        dataset_index[n] = best
        dataset_sample_index[n] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_blend_index(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each global sample as int16, its sample number within that dataset as int64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or w.size > np.iinfo(np.int16).max or not np.all(w > 0):
        raise ValueError(f"blend weights must be 1..32767 positive numbers, got {weights!r}")
    if size < _BLEND_NUMBA_FROM:
        return _fill_blend_index(w / w.sum(), size)
    return _fill_blend_index_numba()(w / w.sum(), np.int64(size))


@functools.cache
def _fill_blend_index_numba():
    """``_fill_blend_index`` compiled by numba (the same code; cached on disk by numba), imported only here."""
    import numba

    return numba.njit(cache=True, nogil=True)(_fill_blend_index)


def gather_sample(tokens, starts, lengths, document_index, sample_index, row: int, out: np.ndarray) -> int:
    """Copy the ``seq_length + 1`` tokens of sample row ``row`` into ``out`` (int64); returns the count.

    ``tokens`` is the whole .bin viewed in its token dtype, ``starts`` each sequence's first token in it."""
    pos, offset = int(sample_index[row, 0]), int(sample_index[row, 1])
    end_pos, end_offset = int(sample_index[row + 1, 0]), int(sample_index[row + 1, 1])
    n = 0
    while True:
        doc = int(document_index[pos])
        stop = end_offset + 1 if pos == end_pos else int(lengths[doc])
        if stop > offset:
            base = int(starts[doc])
            out[n:n + stop - offset] = tokens[base + offset:base + stop]
            n += stop - offset
        if pos == end_pos:
            return n
        pos += 1
        offset = 0
