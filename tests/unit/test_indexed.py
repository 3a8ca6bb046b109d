"""mmtrain.core.indexed: MMIDIDX writer/reader, byte-compatible with Megatron-Core's IndexedDataset."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mmtrain.core.indexed import (MAGIC, IndexedDataset, IndexedDatasetWriter, IndexedFormatError,
                                  read_index_header, token_dtype_for)


def _write(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for start in range(0, len(docs), 3):  # several add() calls, like the pipeline's blocks
            chunk = docs[start:start + 3]
            w.add(np.concatenate([np.asarray(d, dtype) for d in chunk]) if chunk else np.zeros(0, dtype),
                  np.array([len(d) for d in chunk], np.int32))
        w.commit()
    return w


DOCS = [[1, 2, 3], [], [65_000], list(range(1000)), [7]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_and_layout(tmp_path, dtype):
    prefix = tmp_path / "ds"
    w = _write(prefix, DOCS, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents == len(DOCS)
    assert [d.tolist() for d in (ds[i] for i in range(len(ds)))] == DOCS
    assert ds[-1].tolist() == [7] and ds.get(3, 10, 5).tolist() == [10, 11, 12, 13, 14]
    assert ds.num_tokens == sum(map(len, DOCS)) == w.tokens
    assert not ds[0].flags.writeable  # zero-copy view of the mmap
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == MAGIC and struct.unpack_from("<QBQQ", raw, 9) == (1, {np.uint16: 8, np.int32: 4}[dtype], 5, 6)
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    itemsize = np.dtype(dtype).itemsize
    assert ds.pointers.tolist() == [0, 3 * itemsize, 3 * itemsize, 4 * itemsize, 1004 * itemsize]
    assert (tmp_path / "ds.bin").stat().st_size == ds.num_tokens * itemsize
    with pytest.raises(IndexError):
        ds[5]


def test_megatron_core_reads_our_files(tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    for dtype in (np.uint16, np.int32):
        prefix = tmp_path / f"ds_{np.dtype(dtype).name}"
        _write(prefix, DOCS, dtype)
        theirs = mc.IndexedDataset(str(prefix))
        assert len(theirs) == len(DOCS) and theirs.index.dtype == dtype
        assert [theirs[i].tolist() for i in range(len(DOCS))] == DOCS


def test_we_read_megatron_core_files(tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = str(tmp_path / "theirs")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in DOCS:
        builder.add_document(np.asarray(d, np.uint16), [len(d)])
    builder.finalize(prefix + ".idx")
    _write(tmp_path / "ours", DOCS, np.uint16)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
    assert [d.tolist() for d in (IndexedDataset(prefix)[i] for i in range(len(DOCS)))] == DOCS


def test_nothing_visible_before_commit_and_abort_cleans(tmp_path):
    prefix = tmp_path / "ds"
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add(np.array([1, 2], np.uint16), np.array([2], np.int32))
    w.finish()
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds.idx").exists()
    w.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add(np.array([1], np.uint16), np.array([1], np.int32))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_truncated_and_corrupt_files_are_clear_errors(tmp_path):
    prefix = tmp_path / "ds"
    _write(prefix, DOCS, np.uint16)
    bin_file, idx_file = tmp_path / "ds.bin", tmp_path / "ds.idx"
    full_bin = bin_file.read_bytes()
    bin_file.write_bytes(full_bin[:-2])
    with pytest.raises(IndexedFormatError, match=r"ds\.bin.*truncated data file"):
        IndexedDataset(prefix)
    bin_file.write_bytes(full_bin)
    full_idx = idx_file.read_bytes()
    idx_file.write_bytes(full_idx[:-8])
    with pytest.raises(IndexedFormatError, match="truncated index"):
        IndexedDataset(prefix)
    idx_file.write_bytes(b"NOTANIDX!" + full_idx[9:])
    with pytest.raises(IndexedFormatError, match="not an MMIDIDX"):
        read_index_header(idx_file)
    idx_file.write_bytes(full_idx[:10])
    with pytest.raises(IndexedFormatError, match="shorter than"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedFormatError, match="not found"):
        IndexedDataset(tmp_path / "missing")


def test_empty_dataset(tmp_path):
    _write(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.document_indices.tolist() == [0]


def test_dtype_rule():
    assert token_dtype_for(65_499) == np.uint16
    assert token_dtype_for(65_500) == np.int32
