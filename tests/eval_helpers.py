"""A tiny random checkpoint and dataset for the evaluation tests, and the loss computed the plain way."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from mmtrain.config.schema import ModelConfig
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.models.llama.model import GPTModel
from tests.data_helpers import write_text_dataset

VOCAB = 64


def tiny_model_config() -> ModelConfig:
    # init_std large enough that the model is far from uniform: a wrong token or position shows in the loss
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       num_query_groups=2, vocab_size=VOCAB, init_std=0.3)


def write_tiny_checkpoint(root: Path, tp: int = 1, pp: int = 1) -> tuple[Path, GPTModel]:
    """A weights-only checkpoint of a random tiny model, written as a TP x PP run holds it."""
    cfg = tiny_model_config()
    model = GPTModel(cfg)
    model.init_weights(0)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_weights_checkpoint(root, full, cfg, tp, pp)
    return root, model.eval()


def write_tiny_dataset(prefix: Path) -> Path:
    return write_text_dataset(prefix, num_docs=40, max_len=30, token_range=(1, VOCAB), max_id=VOCAB - 1)


@torch.no_grad()
def plain_loss(model: GPTModel, samples, indices) -> tuple[float, int]:
    """Mean next-token cross-entropy over the given samples, one sample at a time, and the tokens counted."""
    total, count = 0.0, 0
    for i in indices:
        tokens = torch.as_tensor(samples[i], dtype=torch.int64)[None]
        logits = model(tokens[:, :-1])
        total += F.cross_entropy(logits[0].double(), tokens[0, 1:], reduction="sum").item()
        count += tokens.shape[1] - 1
    return total / count, count


def train_sentencepiece(folder: Path) -> Path:
    """A SentencePiece model from ``mmtrain-prep train-tokenizer`` (its lossless defaults)."""
    import json

    from dataprep.cli import main as prep_main
    from tests.unit.test_tokenizer import TRAINING_TEXT

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TRAINING_TEXT))
    assert prep_main(["train-tokenizer", "--input", str(corpus), "--output-prefix", str(folder / "sp"),
                      "--vocab-size", "400"]) == 0
    return folder / "sp.model"


def write_checkpoint_for(root: Path, vocab_size: int) -> tuple[Path, GPTModel]:
    """A weights-only checkpoint of a random tiny model with ``vocab_size`` rows."""
    cfg = tiny_model_config()
    cfg.vocab_size = vocab_size
    model = GPTModel(cfg)
    model.init_weights(0)
    write_weights_checkpoint(root, {k: v.detach().clone() for k, v in model.state_dict().items()}, cfg)
    return root, model.eval()
