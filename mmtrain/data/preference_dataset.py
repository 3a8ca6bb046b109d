"""Preference pairs (``data.type=preference``, for ``train.objective=dpo``) from `mmtrain-prep sft --preference`
outputs: ``PREFIX_chosen`` / ``PREFIX_rejected`` and their loss masks, document ``i`` of each from record ``i``.

A sample is an int64 array (8, seq_length + 1): the chosen answer's rows (tokens, loss mask, document,
position; :data:`mmtrain.data.sft_dataset.ROWS`) over the rejected answer's, one conversation each (never packed:
the DPO loss compares whole sequences), in a seeded shuffled order shared by both sides. With ``with_index``
(precomputed reference log-probs) a ninth row holds the pair's document index, which the DPO step looks up.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data.blend_spec import BlendSpecError, blend_from_prefixes, check_text_datasets
from mmtrain.data.gpt_dataset import samples_needed, split_document_ranges
from mmtrain.data.prepared_names import preference_prefixes
from mmtrain.data.reference_logps import read_reference_logps
from mmtrain.data.sft_dataset import SFTSamples
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")


class PreferencePairs:
    """``[i]`` -> int64 (8, seq_length + 1): chosen rows over rejected rows of pair ``i`` (9 rows
    ``with_index``: then the last is the pair's document index)."""

    def __init__(self, prefix: str, seq_length: int, seed: int, num_samples: int,
                 documents: tuple[int, int] | None = None, pad_id: int = 0, with_index: bool = False) -> None:
        self.prefix, self.with_index = prefix, with_index
        chosen, rejected = preference_prefixes(prefix)
        self.chosen = SFTSamples(chosen, seq_length, seed, num_samples, documents, False, pad_id)
        self.rejected = SFTSamples(rejected, seq_length, seed, num_samples, documents, False, pad_id)
        if len(IndexedDataset(chosen)) != len(IndexedDataset(rejected)):
            raise BlendSpecError(f"data.prefixes: {chosen} and {rejected} hold different numbers of "
                                 "pairs; run mmtrain-prep verify on it and re-run the prep")
        self.truncated = max(self.chosen.truncated, self.rejected.truncated)

    def __len__(self) -> int:
        return len(self.chosen)

    def document(self, i: int) -> int:
        """The document (pair) index of sample ``i`` (one conversation per sample)."""
        return int(self.chosen.order[int(self.chosen.sample_start[i % len(self)])])

    def __getitem__(self, i: int) -> np.ndarray:
        rows = [self.chosen[i], self.rejected[i]]
        if self.with_index:
            rows.append(np.full((1, rows[0].shape[1]), self.document(i), np.int64))
        return np.concatenate(rows)


def build_preference_pairs_from_config(cfg, split: str, dp_size: int) -> PreferencePairs:
    """The pairs of ``split`` from the one ``data.prefixes`` entry (the --output-prefix of the prep)."""
    d = cfg.data
    if len(d.prefixes) != 1:
        raise BlendSpecError(f"data.prefixes: data.type=preference reads one prepared prefix, got {len(d.prefixes)}")
    prefix = str(Path(d.prefixes[0]).absolute())
    manifest_path = Path(f"{prefix}.manifest.json")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BlendSpecError(f"data.prefixes: {manifest_path}: {exc}; data.type=preference reads the output of "
                             "mmtrain-prep sft --preference") from None
    if manifest.get("kind") != "preference":
        raise BlendSpecError(f"data.prefixes: {prefix} is not preference data (made by {manifest.get('command')}, "
                             f"kind {manifest.get('kind')}); prepare it with mmtrain-prep sft --preference")
    check_text_datasets(blend_from_prefixes(list(preference_prefixes(prefix)), []).datasets,
                        cfg.model.shape().vocab_size, log)
    count = len(IndexedDataset(preference_prefixes(prefix)[0]))
    begin, end = split_document_ranges(d.split, count)[split]
    if end <= begin:
        raise BlendSpecError(f"data.prefixes: {prefix} has no pairs in the {split} split ({count} in all, split "
                             f"{d.split}); change data.split")
    precomputed = cfg.dpo.reference_logps == "precomputed"
    pairs = PreferencePairs(prefix, d.seq_length, d.seed, samples_needed(cfg, split, dp_size), (begin, end),
                            manifest.get("eod_id") or 0, with_index=precomputed)
    # every pair's reference log-probs (the table is indexed by document), checked against this run
    pairs.reference_logps = read_reference_logps(prefix, count, d.seq_length) if precomputed else None
    if pairs.truncated:
        log.warning("%s: answers longer than data.seq_length + 1 = %d tokens are cut to that length", prefix,
                    d.seq_length + 1)
    pairs.eod_id = manifest.get("eod_id")
    return pairs
