"""A completion's text is decoded a few tokens at a time (a full decode per token made a sequence cost
O(length^2) on the server's engine thread) and is what decoding prompt + completion adds to the prompt's text
(issue #30: SentencePiece dropped a completion's leading space): byte-level BPE (characters split across tokens),
SentencePiece with and without whitespace collapsing (leading '▁' pieces, byte fallback, control ids) and a
Metaspace tokenizer.json, on real text and on random ids."""

from __future__ import annotations

import random

import pytest

from dataprep.cli import main as prep_main
from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.inference.detokenize import CompletionText
from tests.eval_helpers import train_sentencepiece
from tests.inference_helpers import metaspace_tokenizer, tiny_tokenizer

TEXT = "Grüße aus Köln — naïve café, 東京 and emoji 🙂🚀 at the end. Numbers 12345 and code: def f(x): return x"


def _collapsing_sentencepiece(folder):
    path = train_sentencepiece(folder)  # its corpus, trained again with SentencePiece's whitespace collapsing
    assert prep_main(["train-tokenizer", "--input", str(folder / "corpus.jsonl"), "--output-prefix",
                      str(folder / "collapse"), "--vocab-size", "400", "--collapse-whitespace"]) == 0
    return path.with_name("collapse.model")


BUILDERS = {"byte-level BPE": tiny_tokenizer, "sentencepiece": train_sentencepiece,
            "sentencepiece, collapsed whitespace": _collapsing_sentencepiece,
            "metaspace tokenizer.json": metaspace_tokenizer}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tokenizer(request, tmp_path_factory):
    return load_tokenizer(BUILDERS[request.param](tmp_path_factory.mktemp("tok")))


def _streamed(tok, prompt: list[int], ids: list[int]) -> tuple[str, CompletionText]:
    detok = CompletionText(prompt, tok.decode)
    text = ""
    for i in range(len(ids)):
        new = detok.update(ids[:i + 1], finished=i == len(ids) - 1)
        assert new.startswith(text)  # text only ever grows
        text = new
    return text, detok


def _check(tok, prompt: list[int], ids: list[int]) -> str:
    text, detok = _streamed(tok, prompt, ids)
    assert tok.decode(prompt[:detok.prompt_end]) + text == tok.decode(prompt + ids), (prompt, ids)
    once = CompletionText(prompt, tok.decode)  # decoded once at the end: the same text
    assert once.update(ids, finished=True) == text
    return text


def test_prompt_text_plus_completion_is_the_decode_of_both(tokenizer):
    ids = tokenizer.encode(TEXT)
    for cut in range(1, len(ids)):  # some cuts are inside a character
        _check(tokenizer, ids[:cut], ids[cut:])
    rng = random.Random(0)
    # random ids, weighted to the tokens that decode differently at the start of a text (control ids decode
    # to nothing, standalone '▁' pieces to a space or nothing) and to the bytes of a character split over tokens
    singles = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    tricky = ([i for i, text in enumerate(singles) if set(text) <= {" "}]
              + [i for i, text in enumerate(singles) if text == "\ufffd"][:20])
    for _ in range(300):
        def pick():
            return rng.choice(tricky) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
        _check(tokenizer, [pick() for _ in range(rng.randrange(0, 12))], [pick() for _ in range(rng.randrange(1, 12))])


def test_a_completion_keeps_its_leading_space(tokenizer):
    prompt, ids = tokenizer.encode("The quick brown"), tokenizer.encode("The quick brown fox")
    assert ids[:len(prompt)] == prompt and tokenizer.decode(ids) == "The quick brown fox"
    assert _check(tokenizer, prompt, ids[len(prompt):]) == " fox"


def test_a_prompt_that_ends_inside_a_character(tokenizer):
    ids = tokenizer.encode("ok 🦙 go")
    if tokenizer.decode(ids) != "ok 🦙 go":
        pytest.skip("this tokenizer has no byte fallback (the emoji is <unk>)")
    whole = [i for i in range(1, len(ids)) if "🦙" in tokenizer.decode(ids[:i])][0]  # the emoji's last token
    if tokenizer.decode(ids[whole - 1:whole]) == "🦙":
        pytest.skip("this tokenizer has the emoji as one token")
    prompt, completion = ids[:whole - 1], ids[whole - 1:]
    text, detok = _streamed(tokenizer, prompt, completion)
    # the completion's text starts with the whole character; the echo is the prompt's text before it
    assert text.startswith("🦙") and tokenizer.decode(prompt[:detok.prompt_end]) == "ok "
    assert tokenizer.decode(prompt[:detok.prompt_end]) + text == "ok 🦙 go"


def test_each_token_decodes_a_window_not_the_whole_sequence(tokenizer):
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return tokenizer.decode(ids)

    ids = tokenizer.encode(TEXT * 8)
    detok = CompletionText(ids[:50], decode)
    for i in range(50, len(ids)):
        detok.update(ids[50:i + 1])
    assert len(ids) > 300 and max(seen) <= 16
