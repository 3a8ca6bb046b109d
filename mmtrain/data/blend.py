"""Blended GPT samples: several datasets mixed by weight, deterministically and exactly.

Global sample ``n`` comes from dataset ``dataset_index[n]`` (its sample ``dataset_sample_index[n]``); after any
``n`` samples each dataset has supplied ``n * weight`` samples to within one (``gpt_indices.build_blend_index``).
Each dataset is indexed for exactly as many samples as the blend draws from it, and the blend index is cached
next to the datasets' indices. ``build_gpt_samples_from_config`` turns a run config into the samples of one split
(what the training loop calls); the data-parallel size and whether this process builds indices are its
arguments, never read from the environment or the default process group.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data import gpt_indices
from mmtrain.data.blend_spec import (BlendEntry, BlendSpec, BlendSpecError, blend_from_prefixes, check_text_datasets,
                                     load_blend_spec, manifest_tokenizer)
from mmtrain.data.gpt_dataset import (GPTSamples, SPLITS, SplitError, default_cache_dir, samples_needed,
                                      split_document_ranges)
from mmtrain.data.index_cache import IndexCache
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")


class BlendedSamples:
    """``len()`` = the requested size; ``[n]`` -> the sample of dataset ``dataset_index[n]``."""

    def __init__(self, datasets: list[GPTSamples], weights: list[float], size: int,
                 cache_dir: str | os.PathLike, build_timeout_s: float = 1800.0,
                 blend_index: tuple[np.ndarray, np.ndarray] | None = None, index_builder: bool = True) -> None:
        self.datasets, self.size = datasets, int(size)
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        params = {"kind": "blend", "version": 1, "size": self.size, "weights": self.weights,
                  "datasets": [d.cache.key for d in datasets]}
        self._computed = blend_index  # already computed by the caller for the same weights and size
        self.cache = IndexCache(cache_dir, "blend", params, build_timeout_s, index_builder)
        arrays, self.built = self.cache.load_or_build(self._build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self.eod_id: int | None = None

    def _build(self, put) -> None:
        dataset_index, dataset_sample_index = self._computed or gpt_indices.build_blend_index(self.weights, self.size)
        put("dataset_index", dataset_index)
        put("dataset_sample_index", dataset_sample_index)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, n: int) -> np.ndarray:
        if not -self.size <= n < self.size:
            raise IndexError(f"sample {n} out of range for a blend of {self.size} samples")
        n %= self.size
        return self.datasets[int(self.dataset_index[n])][int(self.dataset_sample_index[n])]


def _blend_spec_from_config(cfg) -> BlendSpec:
    d = cfg.data
    if d.blend:
        return load_blend_spec(d.blend)
    if d.prefixes:
        return blend_from_prefixes(list(d.prefixes), list(getattr(d, "weights", []) or []))
    raise BlendSpecError("no training data: set data.blend (a blend-spec file) or data.prefixes, or data.mock=true")


def _split_ranges(spec: BlendSpec, split_setting: str, dataset: IndexedDataset, split: str) -> tuple[int, int]:
    if spec.per_split is not None:
        return 0, len(dataset)
    try:
        return split_document_ranges(spec.split or split_setting, len(dataset))[split]
    except SplitError as exc:
        if spec.split is not None:
            raise BlendSpecError(f"{spec.source}: split: {exc}") from None
        raise


def _split_datasets(cfg, split: str):
    """(the split's entries, their manifest infos, datasets, document ranges, token counts): the blend
    checked (formats, tokenizers across every split, vocabulary) and each dataset to have documents in the split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    spec = _blend_spec_from_config(cfg)
    entries = spec.entries_for(split)
    if not entries:
        raise BlendSpecError(f"{spec.source}: no {split} blend; add a '{split}:' list")
    every_split = spec.datasets if spec.per_split is None else [e for es in spec.per_split.values() for e in es]
    infos = check_text_datasets(every_split, cfg.model.shape().vocab_size, log)  # tokenizers must agree across splits
    infos = [i for i in infos if i.where in {e.where for e in entries}]
    indexed = [IndexedDataset(e.path) for e in entries]
    ranges = [_split_ranges(spec, cfg.data.split, ds, split) for ds in indexed]
    for e, ds, (b, end) in zip(entries, indexed, ranges):
        if end <= b:
            raise BlendSpecError(f"{e.where}: {e.path} has no documents in the {split} split "
                                 f"({len(ds)} documents, split {spec.split or cfg.data.split}); change the split or "
                                 "the blend")
    tokens = [int(ds.lengths[b:end].sum(dtype=np.int64)) for ds, (b, end) in zip(indexed, ranges)]
    return entries, infos, indexed, ranges, tokens


def data_tokenizer(cfg) -> dict | None:
    """The tokenizer record (``type``, ``path``, ``sha256``, ...: ``mmtrain.core.tokenizer_record``) that the
    manifests of the run's text datasets name, over every split (building the samples checks that they agree);
    None for mock data or datasets whose manifests name none. A checkpoint stores it in complete.json."""
    if cfg.data.mock:
        return None
    spec = _blend_spec_from_config(cfg)
    every_split = spec.datasets if spec.per_split is None else [e for es in spec.per_split.values() for e in es]
    return manifest_tokenizer(every_split)


def split_samples_per_pass(cfg, split: str) -> int:
    """How many samples of ``data.seq_length + 1`` tokens one pass over ``split``'s tokens makes (summed over the
    blend's datasets; for one dataset exactly its one-epoch sample count): what an evaluation reads by default."""
    tokens = _split_datasets(cfg, split)[-1]
    return max(1, sum(max(t - 1, 0) for t in tokens) // cfg.data.seq_length)


def build_gpt_samples_from_config(cfg, split: str, dp_size: int, *, index_builder: bool = True,
                                  num_samples: int | None = None):
    """The samples of ``split`` for a run: a ``GPTSamples`` or ``BlendedSamples`` with at least as many samples as
    the run consumes at ``dp_size`` data-parallel ranks (``mesh.dims.dp``; it sizes the run when
    ``train.global_batch_size`` is 0), or ``num_samples`` when given (an evaluation's own count). Checks the blend,
    builds (or loads) every index, logs the mix.
    ``index_builder``: whether this process builds missing indices (``mesh.node_local_rank == 0``; the others
    wait for them). ``.eod_id`` holds the end-of-document id named by the datasets' manifests (or None)."""
    d = cfg.data
    entries, infos, indexed, ranges, tokens = _split_datasets(cfg, split)
    eod_id = _common_eod_id(infos, d)
    size = samples_needed(cfg, split, dp_size) if num_samples is None else int(num_samples)
    if size <= 0:
        raise BlendSpecError(f"the run consumes no {split} samples (train.steps, batch sizes or eval settings are 0)")
    cache_dir = d.cache_dir or default_cache_dir(entries[0].path)
    timeout = float(getattr(d, "index_build_timeout_s", 1800.0))
    weights = [e.weight for e in entries] if entries[0].weight is not None else [float(t) for t in tokens]
    if any(w <= 0 for w in weights):
        bad = entries[weights.index(next(w for w in weights if w <= 0))]
        raise BlendSpecError(f"{bad.where}: {bad.path} has no tokens in the {split} split")

    blend_index = None
    if len(entries) == 1:
        counts = [size]
    else:
        blend_index = gpt_indices.build_blend_index(weights, size)  # tells how many samples each dataset gives
        counts = np.bincount(blend_index[0], minlength=len(entries)).tolist()
    datasets = [GPTSamples(e.path, d.seq_length, d.seed, max(int(c), 1), documents=r, split_name=split,
                           cache_dir=cache_dir, build_timeout_s=timeout, dataset=ds, index_builder=index_builder)
                for e, ds, r, c in zip(entries, indexed, ranges, counts)]
    _log_mix(split, entries, weights, counts, datasets, size, d.seq_length)
    if len(datasets) == 1:
        samples = datasets[0]
    else:
        samples = BlendedSamples(datasets, weights, size, cache_dir, timeout, blend_index, index_builder)
    samples.eod_id = eod_id
    return samples


def _common_eod_id(infos, d) -> int | None:
    """The one end-of-document id of the blend (None when no manifest names one), checked against the
    packed-document options that need it."""
    with_eod = [i for i in infos if i.eod_id is not None]
    if any(i.eod_id != with_eod[0].eod_id for i in with_eod):
        other = next(i for i in with_eod if i.eod_id != with_eod[0].eod_id)
        raise BlendSpecError(f"{other.where}: {other.prefix} ends documents with token {other.eod_id} but "
                             f"{with_eod[0].where} with {with_eod[0].eod_id}; prepare them with the same --eod-token")
    needs = [k for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(d, k, False)]
    if needs and len(with_eod) < len(infos):
        missing = next(i for i in infos if i.eod_id is None)
        raise BlendSpecError(f"{missing.where}: data.{needs[0]} needs end-of-document tokens, but the manifest of "
                             f"{missing.prefix} names no eod_id (prepare it with --append-eod, or turn data.{needs[0]} off)")
    return with_eod[0].eod_id if with_eod else None


def _log_mix(split: str, entries: list[BlendEntry], weights: list[float], counts: list[int],
             datasets: list[GPTSamples], size: int, seq_length: int) -> None:
    total_w = float(sum(weights))
    log.info("%s blend: %d samples of %d tokens from %d dataset(s)", split, size, seq_length + 1, len(entries))
    for e, w, c, ds in zip(entries, weights, counts, datasets):
        used_tokens = c * seq_length  # tokens each sample adds to the stream (samples overlap by one token)
        log.info("  %s: weight %.4f -> %.4f of samples, %.4f of tokens (%d samples, %.2f epochs of its %d tokens)",
                 Path(e.path).name, w / total_w, c / size, used_tokens / (size * seq_length), c,
                 used_tokens / ds.tokens_per_epoch, ds.tokens_per_epoch)

