"""SFT samples (``data.type=sft``): whole conversations of `mmtrain-prep sft` outputs, packed into sequences.

A sample is an int64 array of shape (4, seq_length + 1), rows :data:`ROWS`: the tokens, their loss mask (1 where
the token is the model's to predict, as `mmtrain-prep sft` wrote it), the document (conversation) index of each
token within the sample, and its position inside that conversation. Conversations are taken in a seeded
shuffled order (a new permutation each epoch) and packed greedily: a conversation that does not fit in what is
left of a sample starts the next one; the rest is padding (its own document, no loss). A conversation longer
than ``seq_length + 1`` tokens is cut to that length (prepare with ``--max-length`` to reject those instead).
With ``pack=False`` every sample holds one conversation (the reference the packed samples are tested against).

The training step predicts token ``t + 1`` from tokens ``..t`` of the same conversation only: label ``t``
carries the loss when the mask of token ``t + 1`` is 1 and both tokens are in the same document
(:func:`sft_step_inputs`); attention stays inside documents (``doc_ids``), positions restart at each one. So a
packed batch computes exactly the losses of the same conversations one per sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from mmtrain.core.indexed import IndexedDataset, IndexedFormatError
from mmtrain.data import gpt_indices
from mmtrain.data.blend_spec import BlendSpecError, blend_from_prefixes, check_text_datasets
from mmtrain.data.documents import GPTMicroBatch
from mmtrain.data.gpt_dataset import SPLITS, samples_needed, split_document_ranges
from mmtrain.data.prepared_names import loss_mask_prefix
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")

ROWS = ("tokens", "loss_mask", "document", "position")


def _sft_manifest(prefix: str) -> dict:
    path = Path(f"{prefix}.manifest.json")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlendSpecError(f"data.prefixes: {prefix} has no manifest {path}; data.type=sft reads the output of "
                             "mmtrain-prep sft (run it, or set data.type=gpt for plain text)") from None
    except (OSError, ValueError) as exc:
        raise BlendSpecError(f"{path}: unreadable manifest ({exc}); re-run mmtrain-prep sft") from None
    if manifest.get("command") != "mmtrain-prep sft" or manifest.get("kind") != "sft":
        raise BlendSpecError(f"data.prefixes: {prefix} was made by {manifest.get('command')} "
                             f"({manifest.get('kind', 'text')}), not mmtrain-prep sft without --preference; "
                             "data.type=sft needs conversations with a loss mask")
    return manifest


class SFTSamples:
    """Packed samples over conversations ``[begin, end)`` of one `mmtrain-prep sft` output; at least
    ``num_samples`` of them (whole epochs). ``[i]`` -> int64 (4, seq_length + 1), rows :data:`ROWS`."""

    def __init__(self, prefix: str | os.PathLike, seq_length: int, seed: int, num_samples: int,
                 documents: tuple[int, int] | None = None, pack: bool = True, pad_id: int = 0) -> None:
        self.prefix = os.fspath(prefix)
        try:
            self.tokens = IndexedDataset(self.prefix)
            self.mask = IndexedDataset(loss_mask_prefix(self.prefix))
        except IndexedFormatError as exc:
            raise BlendSpecError(f"data.prefixes: {exc}") from None
        if len(self.mask) != len(self.tokens) or not np.array_equal(self.mask.lengths, self.tokens.lengths):
            raise BlendSpecError(f"data.prefixes: {self.prefix}: the loss mask's document lengths differ from the "
                                 "tokens'; run mmtrain-prep verify on it and re-run the prep")
        self.seq_length, self.pad_id, self.pack = int(seq_length), int(pad_id), bool(pack)
        begin, end = documents if documents is not None else (0, len(self.tokens))
        if end <= begin:
            raise BlendSpecError(f"data.prefixes: {self.prefix} has no conversations in this split")
        cap = self.seq_length + 1
        self.truncated = int((self.tokens.lengths[begin:end] > cap).sum())
        lengths = np.minimum(self.tokens.lengths[begin:end].astype(np.int64), cap)
        rng = np.random.RandomState(seed)
        orders, starts, counts, total = [], [], [], 0
        while total < max(int(num_samples), 1):  # whole epochs until the run has enough samples
            order = begin + rng.permutation(end - begin)
            s, c = _pack(lengths[order - begin], cap if self.pack else 0)
            starts.append(s + sum(o.size for o in orders))
            counts.append(c)
            orders.append(order)
            total += s.size
        self.order = np.concatenate(orders)
        self.sample_start, self.sample_count = np.concatenate(starts), np.concatenate(counts)
        self.num_epochs = len(orders)

    def __len__(self) -> int:
        return int(self.sample_start.size)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples of {self.prefix}")
        i %= n
        cap = self.seq_length + 1
        out = np.zeros((len(ROWS), cap), np.int64)
        out[0] = self.pad_id
        fill = 0
        first = int(self.sample_start[i])
        for doc_index, d in enumerate(self.order[first:first + int(self.sample_count[i])]):
            tokens = self.tokens[int(d)][:cap - fill]
            out[0, fill:fill + tokens.size] = tokens
            out[1, fill:fill + tokens.size] = self.mask[int(d)][:tokens.size]
            out[2, fill:fill + tokens.size] = doc_index
            out[3, fill:fill + tokens.size] = np.arange(tokens.size)
            fill += tokens.size
        if fill < cap:  # padding: a document of its own, no loss
            out[2, fill:] = int(self.sample_count[i])
            out[3, fill:] = np.arange(cap - fill)
        return out


def _pack(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing in order: (first conversation, conversation count) per sample; ``cap`` 0: one each."""
    if cap == 0:
        return np.arange(lengths.size, dtype=np.int64), np.ones(lengths.size, np.int64)
    starts, counts, fill, first = [], [], 0, 0
    for j, n in enumerate(lengths.tolist()):
        if fill and fill + n > cap:
            starts.append(first)
            counts.append(j - first)
            first, fill = j, 0
        fill += n
    starts.append(first)
    counts.append(lengths.size - first)
    return np.asarray(starts, np.int64), np.asarray(counts, np.int64)


class BlendedSFTSamples:
    """Several SFT datasets mixed exactly by weight (the blend index of ``gpt_indices``)."""

    def __init__(self, datasets: list[SFTSamples], weights: list[float], size: int) -> None:
        self.datasets, self.size = datasets, int(size)
        self.dataset_index, self.dataset_sample_index = gpt_indices.build_blend_index(
            [w / sum(weights) for w in weights], self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, n: int) -> np.ndarray:
        n %= self.size
        return self.datasets[int(self.dataset_index[n])][int(self.dataset_sample_index[n])]


def build_sft_samples_from_config(cfg, split: str, dp_size: int):
    """The SFT samples of ``split`` for a run (``data.prefixes`` of `mmtrain-prep sft` outputs, ``data.weights``;
    split by ``data.split`` over conversations), sized for what the run consumes at ``dp_size``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    d = cfg.data
    spec = blend_from_prefixes(list(d.prefixes), list(d.weights or []))
    infos = check_text_datasets(spec.datasets, cfg.model.shape().vocab_size, log)
    manifests = [_sft_manifest(e.path) for e in spec.datasets]
    pad_id = next((m.get("eod_id") for m in manifests if m.get("eod_id") is not None), 0)
    size = samples_needed(cfg, split, dp_size)
    datasets, weights = [], []
    for e, info in zip(spec.datasets, infos):
        count = len(IndexedDataset(e.path))
        begin, end = split_document_ranges(d.split, count)[split]
        if end <= begin:
            raise BlendSpecError(f"{e.where}: {e.path} has no conversations in the {split} split ({count} in all, "
                                 f"split {d.split}); change data.split")
        datasets.append(SFTSamples(e.path, d.seq_length, d.seed, size, (begin, end), d.sft_pack, pad_id))
        weights.append(e.weight if e.weight is not None else float(end - begin))
        if datasets[-1].truncated:
            log.warning("%s: %d conversation(s) longer than data.seq_length + 1 = %d tokens are cut to that length "
                        "(mmtrain-prep sft --max-length rejects them instead)", e.path, datasets[-1].truncated,
                        d.seq_length + 1)
    log.info("%s SFT data: %d samples of %d tokens from %d dataset(s), %s", split, size, d.seq_length + 1,
             len(datasets), "packed" if d.sft_pack else "one conversation per sample")
    samples = datasets[0] if len(datasets) == 1 else BlendedSFTSamples(datasets, weights, size)
    samples.eod_id = pad_id
    return samples


def sft_micro_batch(batch_B4S1: torch.Tensor) -> GPTMicroBatch:
    """A micro-batch of SFT samples as the loop's ``GPTMicroBatch``: tokens, positions and conversation ids, the
    loss where the prep's mask says and the next token belongs to the same conversation."""
    inputs, labels, positions, doc_ids, loss_mask = sft_step_inputs(batch_B4S1)
    return GPTMicroBatch(batch_B4S1[:, 0], positions, doc_ids, loss_mask)


def sft_step_inputs(batch_B4S1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(inputs, labels, positions, doc_ids, loss_mask), each (B, S), from a micro-batch of SFT samples."""
    tokens, mask, doc, pos = (batch_B4S1[:, r] for r in range(len(ROWS)))
    same_doc = doc[:, 1:] == doc[:, :-1]
    loss_mask = (mask[:, 1:].bool() & same_doc).to(torch.float32)
    return tokens[:, :-1], tokens[:, 1:], pos[:, :-1], doc[:, :-1], loss_mask
