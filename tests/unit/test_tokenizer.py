"""mmtrain.core.tokenizer: one interface over SentencePiece and Hugging Face tokenizers, built locally (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmtrain.core.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé — 東京 and Москва; مرحبا and שלום.",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧 and symbols ∑ ∫ ≠ ≤.",
    "Tabs\tand\nnewlines and    spaces.",
    "Numbers 1234567890 and code: def f(x): return x * 2",
] * 20

TRICKY_DOCS = [
    "plain ascii text",
    "Unicode: Café naïve 東京 Москва مرحبا",
    "emoji 🙂👍🏽👨‍👩‍👧 end",
    "NUL\x00inside and \x01 control",
    "line\u2028separator and paragraph\u2029separator and \r carriage",
    "  leading and trailing spaces  ",
]


def build_sentencepiece(folder: Path, vocab_size: int = 600) -> Path:
    import sentencepiece as spm

    prefix = folder / "sp"
    if not (folder / "sp.model").exists():
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(TRAINING_TEXT), model_prefix=str(prefix), vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, hard_vocab_limit=False, minloglevel=2,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1)
    return folder / "sp.model"


def build_hf_bpe(folder: Path, with_config: bool = True) -> Path:
    """Byte-level BPE with </s> as eos (in tokenizer_config.json) and one added token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.add_special_tokens(["<|extra|>"])
    tok.save(str(folder / "tokenizer.json"))
    if with_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"


def build_hf_wide(folder: Path, size: int = 70_000) -> Path:
    """Word-level tokenizer whose ids go past 65,500 (forces int32 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def build_gpt2_files(folder: Path, vocab_name: str = "vocab.json", merges_name: str = "merges.txt") -> Path:
    """GPT-2-format vocab.json + merges.txt (byte-level BPE, <|endoftext|> in the vocabulary), trained locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT + ["it's we'll they'd I'm you've", "<|endoftext|> as text"], trainer)
    vocab, merges = tok.model.save(str(folder))
    if vocab_name != "vocab.json":
        Path(vocab).rename(folder / vocab_name)
        Path(merges).rename(folder / merges_name)
    return folder / vocab_name


def gpt2_reference_encode(vocab_file: Path, merges_file: Path, text: str) -> list[int]:
    """Byte-level BPE as the GPT-2 paper's encoder defines it, written out plainly (slow, for checking)."""
    import regex

    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    lines = merges_file.read_text(encoding="utf-8").split("\n")
    rank = {tuple(line.split(" ")): i for i, line in enumerate(x for x in lines[1:] if x)}
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    words = regex.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+", text)
    ids = []
    for word in words:
        parts = [char_of[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: rank.get((parts[i], parts[i + 1]), 1 << 60))
            pair = (parts[best], parts[best + 1])
            if pair not in rank:
                break
            merged, i = [], 0
            while i < len(parts):  # every occurrence of the best pair, left to right
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids.extend(vocab[p] for p in parts)
    return ids


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory) -> Path:
    return build_hf_bpe(tmp_path_factory.mktemp("hf"))


def test_sentencepiece_interface(sp_model):
    import sentencepiece as spm

    tok = load_tokenizer(sp_model)
    ref = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == ref.get_piece_size() and tok.max_id == tok.vocab_size - 1
    assert tok.eod_id == ref.eos_id() == 2
    assert tok.encode_batch(TRICKY_DOCS) == [ref.encode(d) for d in TRICKY_DOCS]
    tok.set_threads(2)
    assert tok.encode_batch(TRICKY_DOCS) == [ref.encode(d) for d in TRICKY_DOCS]
    assert tok.decode(tok.encode("Café 🙂 東京")) == "Café 🙂 東京"  # byte fallback: nothing lost
    assert len(tok.checksum()) == 64
    assert tok.describe()["eod_id"] == 2


def test_huggingface_interface_file_and_folder(hf_json):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(hf_json))
    for source in (hf_json, hf_json.parent):
        tok = load_tokenizer(source)
        assert isinstance(tok, HuggingFaceTokenizer)
        assert tok.eod_id == ref.token_to_id("</s>")
        assert tok.max_id == ref.token_to_id("<|extra|>")  # added tokens count
        assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
        assert tok.encode_batch(TRICKY_DOCS) == [ref.encode(d, add_special_tokens=False).ids for d in TRICKY_DOCS]
        assert tok.decode(tok.encode("NUL\x00 🙂")) == "NUL\x00 🙂"


def test_hf_eos_without_config_and_override(tmp_path):
    path = build_hf_bpe(tmp_path / "noconf", with_config=False)
    assert load_tokenizer(path).eod_id == load_tokenizer(path).token_id("</s>")  # known eos names are tried
    assert load_tokenizer(path, eod_token="<|extra|>").eod_id == load_tokenizer(path).token_id("<|extra|>")
    with pytest.raises(TokenizerError, match="not a token"):
        load_tokenizer(path, eod_token="<nope>")


def test_type_override_and_errors(tmp_path, sp_model):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "missing.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        load_tokenizer(junk)
    with pytest.raises(TokenizerError, match="not a Hugging Face"):
        load_tokenizer(sp_model, "huggingface")


def test_wide_vocab_max_id(tmp_path):
    tok = load_tokenizer(build_hf_wide(tmp_path / "wide"))
    assert tok.max_id == 69_999 and tok.eod_id == 1
    assert tok.encode("w69999 w5") == [69_999, 5]


def test_train_tokenizer_is_lossless_and_sampled(tmp_path):
    from dataprep.cli import main as prep

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t + f" {i}"}) + "\n" for i, t in enumerate(TRAINING_TEXT))
                    + "not json\n")
    prefix = tmp_path / "tok" / "sp"
    assert prep(["train-tokenizer", "--input", str(data), "--output-prefix", str(prefix), "--vocab-size", "400",
                 "--sample-docs", "50"]) == 0
    tok = load_tokenizer(f"{prefix}.model")
    assert tok.eod_id == 2 and tok.vocab_size <= 400
    for text in TRICKY_DOCS + ["    indented\n\tcode  with  double  spaces  "]:
        assert tok.decode(tok.encode(text)) == text
    m = json.loads((tmp_path / "tok" / "sp.manifest.json").read_text())
    assert m["documents"] == {"read": len(TRAINING_TEXT), "bad": 1, "sampled": 50}
    assert m["model"]["sha256"] == tok.checksum()


GPT2_DOCS = TRICKY_DOCS + ["<|endoftext|> is plain text here", "it's they'll I'M 'S  \t\n\n  x",
                           "\x1c\x1d\x1e\x1f \x85 \xa0 \u3000 \u200b \ufeff", "١٢٣ ½ ² Ⅳ a\u0301", ""]


def test_gpt2_files_match_the_reference_algorithm(tmp_path):
    vocab = build_gpt2_files(tmp_path / "g")
    merges = vocab.with_name("merges.txt")
    for source, kwargs in ((vocab.parent, {}), (vocab, {}), (vocab, {"merge_file": merges}),
                           (vocab.parent, {"tokenizer_type": "gpt2-bpe"})):
        tok = load_tokenizer(source, **kwargs)
        assert isinstance(tok, GPT2BPETokenizer) and tok.type == "gpt2-bpe"
        assert tok.eod_id == json.loads(vocab.read_text())["<|endoftext|>"]
        assert tok.max_id == tok.vocab_size - 1 == len(json.loads(vocab.read_text())) - 1
        assert tok.encode_batch(GPT2_DOCS) == [gpt2_reference_encode(vocab, merges, d) for d in GPT2_DOCS]
        assert tok.decode(tok.encode("NUL\x00 🙂 <|endoftext|>")) == "NUL\x00 🙂 <|endoftext|>"
        assert tok.describe()["merges_path"] == str(merges) and len(tok.checksum()) == 64
    tok.set_threads(2)
    assert tok.encode_batch(GPT2_DOCS) == [gpt2_reference_encode(vocab, merges, d) for d in GPT2_DOCS]


def test_gpt2_file_names_and_errors(tmp_path):
    named = build_gpt2_files(tmp_path / "n", "gpt2-vocab.json", "gpt2-merges.txt")
    assert load_tokenizer(named).merges_path == named.with_name("gpt2-merges.txt")  # sibling found by name
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "vocab.json").write_text(named.read_text())
    with pytest.raises(TokenizerError, match="needs vocab.json and merges.txt"):
        load_tokenizer(lone / "vocab.json", "gpt2-bpe")
    (lone / "merges.txt").write_text("#version: 0.2\nzz qq\n")  # merges of tokens the vocabulary lacks
    with pytest.raises(TokenizerError, match="not a GPT-2 vocab/merges pair"):
        load_tokenizer(lone)
