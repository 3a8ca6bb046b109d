"""Small synthetic indexed datasets (with the manifest mmtrain-prep would write) for the data tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmtrain.config.schema import GPTRunConfig
from mmtrain.core.indexed import IndexedDatasetWriter

EOD = 0


def write_text_dataset(prefix, num_docs: int = 200, seed: int = 0, max_len: int = 60, token_range=(1, 500),
                       eod: int | None = EOD, dtype=np.uint16, tokenizer_sha: str = "tok-a", max_id: int = 511,
                       manifest: bool = True) -> Path:
    """Documents of random length (1..max_len) with ids in token_range, each ending in ``eod`` if given."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=num_docs).astype(np.int32)
    tokens = rng.integers(token_range[0], token_range[1], size=int(lengths.sum())).astype(dtype)
    if eod is not None:
        tokens[np.cumsum(lengths) - 1] = eod
    prefix = Path(prefix)
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add(tokens, lengths)
        w.commit()
    if manifest:
        Path(f"{prefix}.manifest.json").write_text(json.dumps({
            "format": 1, "tokenizer": {"type": "sentencepiece", "path": "/tok.model", "sha256": tokenizer_sha,
                                       "vocab_size": max_id + 1, "max_id": max_id, "eod_id": eod},
            "append_eod": eod is not None, "eod_id": eod}))
    return prefix


def run_config(tmp_path, **data) -> GPTRunConfig:
    cfg = GPTRunConfig()
    cfg.data.seq_length = 16
    cfg.data.cache_dir = str(Path(tmp_path) / "cache")
    cfg.train.steps, cfg.train.micro_batch_size = 10, 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg
