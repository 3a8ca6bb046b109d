"""Streaming text is decoded a few tokens at a time (a full decode per token made a sequence cost O(length^2) on
the server's engine thread), and still equals the full decode: byte-level BPE (characters split across tokens)
and SentencePiece (a word's leading space), on real text and on random ids."""

from __future__ import annotations

import random

import pytest

from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.inference.engine import Sequence, _decode_incrementally
from mmtrain.inference.sampling import SamplingParams
from tests.eval_helpers import train_sentencepiece
from tests.inference_helpers import tiny_tokenizer

TEXT = "Grüße aus Köln — naïve café, 東京 and emoji 🙂🚀 at the end. Numbers 12345 and code: def f(x): return x"


@pytest.fixture(scope="module", params=["byte-level BPE", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    path = tiny_tokenizer(folder) if request.param == "byte-level BPE" else train_sentencepiece(folder)
    return load_tokenizer(path)


def _streamed(tok, ids: list[int]) -> str:
    s = Sequence([1], SamplingParams(max_new_tokens=len(ids)), decode=tok.decode)
    pieces = []
    for i, t in enumerate(ids):
        s.token_ids.append(t)
        if i == len(ids) - 1:
            s.finish_reason = "length"
        before = s._decoded
        text = _decode_incrementally(s)
        assert text.startswith(before)  # text only ever grows
        pieces.append(text[len(before):])
    return "".join(pieces)


def test_streamed_text_equals_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert _streamed(tokenizer, ids) == tokenizer.decode(ids)
    rng = random.Random(0)
    for _ in range(20):  # random ids: partial characters, odd merges
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        assert _streamed(tokenizer, ids) == tokenizer.decode(ids), ids
