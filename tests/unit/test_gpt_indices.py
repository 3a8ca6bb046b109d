"""The index builders in numpy (mmtrain/data/gpt_indices.py): the sample index is the token stream cut every
``seq_length`` tokens whatever the chunk sizes (empty documents included), gathers return exactly those windows,
and the blend index is the same from the Python loop and from numba (used for large sizes)."""

from __future__ import annotations

import numpy as np
import pytest

from mmtrain.data import gpt_indices


def _case(seed: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0 if seed % 2 else 1, 40, size=int(rng.integers(1, 50))).astype(np.int32)
    lengths[0] += 3 * (lengths.sum() < 3)
    epochs, seq_length = int(rng.integers(1, 4)), int(rng.integers(1, 30))
    document_index = gpt_indices.build_document_index(np.arange(len(lengths)), epochs, np.random.RandomState(seed),
                                                      False)
    return lengths, document_index, seq_length, epochs


@pytest.mark.parametrize("docs_per_chunk, rows_per_chunk", [(1 << 22, 1 << 22), (1, 1), (3, 2), (7, 5)])
def test_sample_index_cuts_the_token_stream_every_seq_length_tokens(monkeypatch, docs_per_chunk, rows_per_chunk):
    monkeypatch.setattr(gpt_indices, "_DOCS_PER_CHUNK", docs_per_chunk)
    monkeypatch.setattr(gpt_indices, "_ROWS_PER_CHUNK", rows_per_chunk)
    for seed in range(60):
        lengths, document_index, seq_length, epochs = _case(seed)
        tokens_per_epoch = int(lengths.sum())
        if gpt_indices.num_indexed_samples(tokens_per_epoch, epochs, seq_length) < 1:
            continue
        index = gpt_indices.build_sample_index(lengths, document_index, seq_length, tokens_per_epoch, epochs)
        starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
        tokens = np.random.default_rng(seed).integers(0, 60_000, size=tokens_per_epoch).astype(np.uint16)
        stream = np.concatenate([tokens[starts[d]:starts[d] + lengths[d]] for d in document_index]).astype(np.int64)
        before = np.concatenate([[0], np.cumsum(lengths[document_index], dtype=np.int64)])
        rows = np.arange(len(index))
        assert np.array_equal(before[index[:, 0]] + index[:, 1], rows * seq_length), seed
        # a row never points at an empty document or past one's end (row 0 is (0, 0), as Megatron's)
        assert np.all(index[1:, 1] < lengths[document_index[index[1:, 0]]]), seed
        out = np.empty(seq_length + 1, np.int64)
        for row in range(len(index) - 1):
            got = gpt_indices.gather_sample(tokens, starts, lengths, document_index, index, row, out)
            assert got == seq_length + 1
            assert np.array_equal(out, stream[row * seq_length:row * seq_length + seq_length + 1]), (seed, row)


def test_the_blend_index_is_the_same_from_python_and_from_numba():
    rng = np.random.default_rng(0)
    compiled = gpt_indices._fill_blend_index_numba()
    for k in (1, 2, 3, 8):
        weights = rng.random(k) + 0.01
        weights /= weights.sum()
        python = gpt_indices._fill_blend_index(weights, 3000)
        numba = compiled(weights, np.int64(3000))
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(python, numba))


def test_large_blends_use_numba_and_small_ones_do_not(monkeypatch):
    calls = []
    real = gpt_indices._fill_blend_index_numba

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(gpt_indices, "_fill_blend_index_numba", counting)
    gpt_indices.build_blend_index([1.0, 3.0], gpt_indices._BLEND_NUMBA_FROM - 1)
    assert not calls
    a, b = gpt_indices.build_blend_index([1.0, 3.0], gpt_indices._BLEND_NUMBA_FROM)
    assert calls and a.shape == b.shape == (gpt_indices._BLEND_NUMBA_FROM,)
    assert np.bincount(a).tolist() == [gpt_indices._BLEND_NUMBA_FROM // 4, 3 * gpt_indices._BLEND_NUMBA_FROM // 4]
