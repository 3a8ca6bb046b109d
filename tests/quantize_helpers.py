"""A tiny model trained on prepared text, for the quantization tests: a corpus from the demo's sample generator,
prepared with ``mmtrain-prep text`` and a tiny byte-level BPE tokenizer, and a few hundred AdamW steps of a
2-layer model whose linears hold whole int4 groups of 128 (a random model tells nothing about quantization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mmtrain.config.schema import ModelConfig
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.core.indexed import IndexedDataset
from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.models.llama.model import GPTModel
from tests.inference_helpers import tiny_tokenizer

SEQ = 64


def quant_config() -> ModelConfig:
    """Widths that are multiples of 128 (the W4A16 group), GQA, untied output."""
    return ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                       num_query_groups=2, vocab_size=512, init_std=0.05)


def prepared_corpus(folder: Path, docs: int = 600, seed: int = 5,
                    tokenizer: Path | None = None) -> tuple[Path, Path]:
    """(prefix of a prepared sample corpus of ``docs`` documents, its tokenizer.json) in ``folder``; a new tiny
    tokenizer unless ``tokenizer`` is given."""
    from dataprep.cli import main as prep_main
    from dataprep.samples import write_sample_jsonl

    tok = tokenizer or tiny_tokenizer(folder / "tok")
    raw = write_sample_jsonl(folder / "raw.jsonl", docs, seed=seed)
    prefix = folder / "corpus"
    assert prep_main(["text", "--input", str(raw), "--output-prefix", str(prefix), "--tokenizer", str(tok),
                      "--append-eod", "--workers", "1", "--no-progress"]) == 0
    return prefix, tok


def trained_checkpoint(root: Path, prefix: Path, tokenizer: Path, steps: int = 300, seed: int = 0) -> Path:
    """A weights-only checkpoint of ``quant_config()`` trained ``steps`` AdamW steps on windows of ``prefix``
    (fixed seeds, one thread: the same numbers on every machine), naming ``tokenizer``; returns the checkpoint root."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(root, prefix, tokenizer, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train(root: Path, prefix: Path, tokenizer: Path, steps: int, seed: int) -> Path:
    torch.manual_seed(seed)
    tokens = torch.from_numpy(np.concatenate([IndexedDataset(str(prefix))[i] for i in
                                              range(len(IndexedDataset(str(prefix))))]).astype(np.int64))
    cfg = quant_config()
    model = GPTModel(cfg)
    model.init_weights(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - SEQ - 1, (8,), generator=g)
        batch = torch.stack([tokens[s:s + SEQ + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    meta = {"tokenizer": load_tokenizer(tokenizer).describe()}
    write_weights_checkpoint(root, {k: v.detach().clone() for k, v in model.state_dict().items()}, cfg,
                             extra_meta=meta)
    return root
