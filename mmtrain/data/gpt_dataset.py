"""GPT samples: ``seq_length + 1`` tokens that run across document boundaries, from indexed datasets.

``GPTSamples`` covers one document range (a split) of one ``PREFIX.bin/.idx`` pair; its index arrays come
from ``mmtrain.data.gpt_indices`` (equal to Megatron-Core's for the same data, range, seed and sizes) and are
cached by ``mmtrain.data.index_cache``. ``samples_needed`` sizes a split from the run length; the training loop
gets its samples from ``mmtrain.data.blend.build_gpt_samples_from_config``, which builds ``GPTSamples`` and
blends them (that module imports this one, never the reverse).

``packed_document_inputs`` (``mmtrain.data.documents``, re-exported here) gives the per-token position ids,
document ids and loss mask of packed samples, so attention and positions can restart at every end-of-document
token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data import gpt_indices
from mmtrain.data.documents import packed_document_inputs  # noqa: F401 - re-exported
from mmtrain.data.index_cache import IndexCache, file_identity
from mmtrain.data.splits import SPLITS, SplitError, parse_split, split_document_ranges  # noqa: F401 - re-exported
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")

INDEX_VERSION = 1  # bump when the index algorithm changes: old cache entries then stop matching


def default_cache_dir(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.cache")


class GPTSamples:
    """Samples over documents ``[begin, end)`` of one indexed dataset: ``len()`` and ``[i]`` -> int64 array
    of ``seq_length + 1`` tokens. At least ``num_samples`` samples exist (whole epochs are indexed)."""

    eod_id: int | None = None  # set by blend.build_gpt_samples_from_config from the manifests

    def __init__(self, prefix: str | os.PathLike, seq_length: int, seed: int, num_samples: int,
                 documents: tuple[int, int] | None = None, split_name: str = "train",
                 cache_dir: str | os.PathLike | None = None, build_timeout_s: float = 1800.0,
                 dataset: IndexedDataset | None = None, index_builder: bool = True) -> None:
        """``index_builder``: whether this process builds missing index arrays (``IndexCache.builder``)."""
        self.prefix = str(prefix)
        self.dataset = dataset if dataset is not None else IndexedDataset(prefix)
        self.seq_length, self.seed, self.num_samples = int(seq_length), int(seed), int(num_samples)
        begin, end = documents if documents is not None else (0, len(self.dataset))
        self.documents = (int(begin), int(end))
        if not 0 <= begin <= end <= len(self.dataset):
            raise ValueError(f"{self.prefix}: document range {self.documents} outside 0..{len(self.dataset)}")
        lengths = self.dataset.lengths
        self.tokens_per_epoch = int(lengths[begin:end].sum(dtype=np.int64))
        if self.tokens_per_epoch < 2:
            raise ValueError(f"{self.prefix}: the {split_name} split (documents {begin}..{end}) has "
                             f"{self.tokens_per_epoch} tokens; it needs at least 2 -- adjust data.split or add data")
        if self.seq_length < 1 or self.num_samples < 0:
            raise ValueError(f"seq_length must be >= 1 and num_samples >= 0, got {seq_length}, {num_samples}")
        self.num_epochs = gpt_indices.num_epochs_for(self.tokens_per_epoch, max(self.num_samples, 1), self.seq_length)
        params = {"kind": "gpt", "version": INDEX_VERSION, "idx": file_identity(self.dataset.idx_path),
                  "bin": file_identity(self.dataset.bin_path), "documents": list(self.documents),
                  "seq_length": self.seq_length, "seed": self.seed, "num_samples": self.num_samples}
        folder = cache_dir if cache_dir else default_cache_dir(self.prefix)
        self.cache = IndexCache(folder, f"gpt-{Path(self.prefix).name}-{split_name}", params, build_timeout_s,
                                index_builder)
        arrays, self.built = self.cache.load_or_build(self._build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._tokens = self._starts = None  # typed views for the gather kernel, made on first access

    def _views(self) -> tuple[np.ndarray, np.ndarray]:
        """The .bin in its token dtype and each sequence's first token in it: token t of sequence s is
        ``tokens[starts[s] + t]``."""
        if self._tokens is None:
            ds = self.dataset
            itemsize = ds.dtype.itemsize
            self._starts = np.ascontiguousarray(ds.pointers // itemsize)
            self._tokens = (np.memmap(ds.bin_path, dtype=ds.dtype, mode="r", shape=(ds.data_end // itemsize,))
                            if ds.data_end else np.zeros(1, ds.dtype))
        return self._tokens, self._starts

    def _build(self, put) -> None:
        begin, end = self.documents
        num_samples = max(self.num_samples, 1)
        separate = gpt_indices.separate_last_epoch(self.tokens_per_epoch, num_samples, self.seq_length,
                                                   self.num_epochs)
        rng = np.random.RandomState(self.seed)
        documents = np.arange(begin, end, dtype=np.int32)
        document_index = gpt_indices.build_document_index(documents, self.num_epochs, rng, separate)
        put("document_index", document_index)  # written in the background while the rest is computed
        total = gpt_indices.num_indexed_samples(self.tokens_per_epoch, self.num_epochs, self.seq_length)
        sample_index = gpt_indices.build_sample_index(self.dataset.lengths, document_index, self.seq_length,
                                                      self.tokens_per_epoch, self.num_epochs)
        assert sample_index.shape[0] == total + 1
        put("sample_index", sample_index)
        first = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length if separate else total
        put("shuffle_index", gpt_indices.build_shuffle_index(first, total, rng))

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples of {self.prefix}")
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        tokens, starts = self._views()
        got = gpt_indices.gather_sample(tokens, starts, self.dataset.lengths, self.document_index,
                                        self.sample_index, int(self.shuffle_index[i % n]), out)
        assert got == self.seq_length + 1, (got, self.seq_length)
        return out


def samples_needed(cfg, split: str, dp_size: int = 1) -> int:
    """Samples the run consumes: train = steps x global batch; valid = every evaluation's micro-batches
    (one more evaluation than ``steps // eval_every``, as Megatron sizes it); test = one evaluation."""
    t = cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * dp_size
    per_eval = t.eval_steps * gbs  # an evaluation step is one global batch, whatever the layout
    if split == "train":
        return t.steps * gbs
    if split == "valid":
        return (t.steps // t.eval_every + 1) * per_eval if t.eval_every > 0 else per_eval
    if split == "test":
        return per_eval
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
