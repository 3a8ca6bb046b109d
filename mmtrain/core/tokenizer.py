"""One tokenizer interface over SentencePiece ``.model`` files, Hugging Face ``tokenizer.json`` files and
GPT-2-format byte-level BPE files (``vocab.json`` + ``merges.txt``, what Megatron-LM's ``GPT2BPETokenizer`` reads).

Both libraries do the real work (batch encoding in C++ / Rust); this module only gives them the same face:
``encode``, ``encode_batch``, ``decode``, ``vocab_size``, ``max_id`` (added tokens included: it decides the
token dtype), ``eod_id`` (the end-of-sequence id appended by ``--append-eod``) and ``checksum``.
Encoding never adds BOS/EOS by itself, so ``--append-eod`` is the only special token we insert.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

from mmtrain.core.sentencepiece_offsets import piece_offsets


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or of another kind than asked for; the message names the file and
    the fix (``mmtrain-prep`` prints it as one line and exits 2, like its own ``PrepError``)."""


TOKENIZER_TYPES = ("sentencepiece", "huggingface", "gpt2-bpe")
# GPT-2 files: Megatron-LM hard-codes this token as the end of document of its GPT2BPETokenizer.
GPT2_EOD = "<|endoftext|>"
# Tried in order when a Hugging Face tokenizer folder has no tokenizer_config.json naming its eos_token.
_HF_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def file_sha256(path: str | os.PathLike, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Tokenizer(ABC):
    """What the prep commands need from a tokenizer. ``path`` is the file that defines it."""

    type: str
    path: Path
    eod_id: int | None
    bos_id: int | None = None  # beginning-of-text id when the tokenizer defines one (SentencePiece's bos)

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def max_id(self) -> int: ...

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves out control/special tokens (and ``<unk>``), as
        transformers' decode does with the same flag."""

    @abstractmethod
    def token_id(self, token: str) -> int | None:
        """The id of one token string, or None when the vocabulary lacks it."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @abstractmethod
    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Ids and each token's character span ``[start, end)`` in its text (what a loss mask over character
        spans needs), as Hugging Face ``tokenizers`` reports them."""

    def set_threads(self, threads: int) -> None:
        """Threads the library may use inside one ``encode_batch`` call."""

    def control_tokens(self) -> dict[str, int]:
        """Strings that are one control token of their own (``<|im_start|>``, ``</s>``): the tokens a chat template
        writes and message text must not (``mmtrain.core.chat_tokens``). Plain text never yields them."""
        return {}

    def checksum(self) -> str:
        return file_sha256(self.path)

    def describe(self) -> dict:
        return {"type": self.type, "path": str(self.path), "sha256": self.checksum(),
                "vocab_size": self.vocab_size, "max_id": self.max_id, "eod_id": self.eod_id}


def listed_special_tokens(folder: Path) -> list[str]:
    """The special tokens ``folder/tokenizer_config.json`` lists (``additional_special_tokens``,
    ``extra_special_tokens``: strings, ``{"content": ...}`` objects, or a name -> token mapping), in order."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return []
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{config_path}: unreadable ({exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_path}: not a JSON object; fix or remove it")
    tokens: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        listed = config.get(key) or []
        for item in listed.values() if isinstance(listed, dict) else listed:
            token = item.get("content") if isinstance(item, dict) else item
            if not isinstance(token, str):
                raise TokenizerError(f"{config_path}: {key} holds {item!r}, not a token string")
            if token not in tokens:
                tokens.append(token)
    return tokens


class SentencePieceTokenizer(Tokenizer):
    type = "sentencepiece"

    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises bare RuntimeError/OSError
            raise TokenizerError(f"{path}: not a SentencePiece model ({exc}); pass --tokenizer-type if it is "
                            "a Hugging Face tokenizer") from None
        eos = self._sp.eos_id()
        self.eod_id = eos if eos >= 0 else None
        bos = self._sp.bos_id()
        self.bos_id = bos if bos >= 0 else None  # what evaluation harnesses put before a text with no context
        self._threads = 1
        self._control: dict[str, int] | None = None
        # the tokens the folder's tokenizer_config.json declares special (train-tokenizer --chat-template /
        # --special-tokens writes it): user-defined pieces, read out of text as one token, so a chat template's
        # control tokens; pieces of this model only (a config may describe a wider tokenizer)
        self._special = {t: self._sp.piece_to_id(t) for t in listed_special_tokens(path.parent)
                         if self.token_id(t) is not None}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def max_id(self) -> int:
        return self._sp.get_piece_size() - 1

    def set_threads(self, threads: int) -> None:
        self._threads = max(1, int(threads))

    def control_tokens(self) -> dict[str, int]:
        # SentencePiece never reads control pieces (<s>, </s>) out of text (a chat template's are split out);
        # the declared special tokens are user-defined pieces, which it reads wherever they occur
        if self._control is None:
            self._control = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())
                             if self._sp.is_control(i)}
            self._control.update(self._special)
        return self._control

    def char_ids(self, char: str) -> list[int]:
        """The ids of one character on its own, as SentencePiece encodes it inside a text: its piece, else its
        UTF-8 bytes' pieces (byte fallback), else ``<unk>``."""
        piece = self.token_id(char)
        if piece is not None:
            return [piece]
        pieces = [self.token_id(f"<0x{b:02X}>") for b in char.encode("utf-8", "surrogatepass")]
        return pieces if None not in pieces else [self._sp.unk_id()]

    def token_id(self, token: str) -> int | None:
        piece_id = self._sp.piece_to_id(token)
        return None if piece_id == self._sp.unk_id() and token != self._sp.id_to_piece(piece_id) else piece_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int, num_threads=self._threads)

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return piece_offsets(self._sp, texts, self._threads)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = set(self._special.values())
            ids = [i for i in ids if not (self._sp.is_control(i) or self._sp.is_unknown(i) or i in special)]
        return self._sp.decode(ids)


class HuggingFaceTokenizer(Tokenizer):
    type = "huggingface"

    def __init__(self, path: Path, add_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        folder = path if path.is_dir() else path.parent
        self.path = path / "tokenizer.json" if path.is_dir() else path
        if not self.path.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json there; pass a tokenizer.json file or a folder holding one")
        try:
            self._tk = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # noqa: BLE001
            raise TokenizerError(f"{self.path}: not a Hugging Face tokenizer.json ({exc})") from None
        self._add_special = add_special_tokens
        self._vocab = self._tk.get_vocab(with_added_tokens=True)
        self.eod_id = self._find_eos(folder)
        self._encode = getattr(self._tk, "encode_batch_fast", self._tk.encode_batch)
        self._control = {t.content: i for i, t in self._tk.get_added_tokens_decoder().items() if t.special}
        self._plain: dict[bool, object] = {}  # plain-text twins of the tokenizer, built when first needed

    def _find_eos(self, folder: Path) -> int | None:
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config}: unreadable ({exc})") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and eos in self._vocab:
                return self._vocab[eos]
        for token in _HF_EOS_CANDIDATES:
            if token in self._vocab:
                return self._vocab[token]
        return None

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        return max(self._vocab.values()) if self._vocab else -1

    def token_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def set_threads(self, threads: int) -> None:
        # The Rust thread pool is sized once per process, from this variable, before its first parallel use.
        if threads <= 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        else:
            os.environ.setdefault("RAYON_NUM_THREADS", str(threads))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._encode(list(texts), add_special_tokens=self._add_special)]

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return [(e.ids, e.offsets) for e in self._tk.encode_batch(list(texts), add_special_tokens=self._add_special)]

    def control_tokens(self) -> dict[str, int]:
        return self._control  # the special added tokens (transformers' special tokens)

    def encode_plain_batch_with_offsets(self, texts: Sequence[str], continuation: bool = False
                                        ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """``encode_batch_with_offsets`` with the control tokens read as text. ``continuation``: the texts
        follow a control token, where a tokenizer that prefixes a space only at the start of the whole input
        (Metaspace ``prepend_scheme: first``) adds none."""
        if continuation not in self._plain:
            from tokenizers import Tokenizer as HFTokenizer

            spec = json.loads(self._tk.to_str())
            if continuation:
                _prepend_never(spec.get("pre_tokenizer"))
            plain = HFTokenizer.from_str(json.dumps(spec))
            plain.encode_special_tokens = True
            self._plain[continuation] = plain
        encoded = self._plain[continuation].encode_batch(list(texts), add_special_tokens=False)
        return [(e.ids, e.offsets) for e in encoded]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` that encodes and decodes (what an HF export copies)."""
        return self._tk

    def checksum(self) -> str:
        return file_sha256(self.path)


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2-format byte-level BPE (``vocab.json`` + ``merges.txt``), encoded by the Rust ``tokenizers`` library.

    Built exactly like the original GPT-2 encoder: GPT-2's pre-tokenization regex on the raw text, bytes mapped
    to printable characters, merges applied by rank; no normalizer, no prefix space, and no added/special
    tokens, so ``<|endoftext|>`` inside a document is plain text (as in Megatron-LM's ``GPT2BPETokenizer``).
    The end of document is the vocabulary's ``<|endoftext|>``. The ids equal Megatron-LM's pure-Python
    implementation (``bench/prep_text.py`` compares the .bin/.idx bytes).
    """

    type = "gpt2-bpe"

    def __init__(self, vocab: Path, merges: Path | None = None) -> None:  # no super().__init__: built from two files
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.path = vocab / "vocab.json" if vocab.is_dir() else vocab
        self.merges_path = merges or gpt2_merges_for(vocab)
        if not self.path.is_file() or self.merges_path is None or not self.merges_path.is_file():
            raise TokenizerError(f"{vocab}: a GPT-2 tokenizer needs vocab.json and merges.txt; pass a folder holding "
                            "both, or the vocab file and --merge-file")
        try:
            model = models.BPE.from_file(str(self.path), str(self.merges_path))
        except Exception as exc:  # noqa: BLE001 - the library raises bare Exception
            raise TokenizerError(f"{self.path} + {self.merges_path}: not a GPT-2 vocab/merges pair ({exc})") from None
        self._tk = HFTokenizer(model)
        self._tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tk.decoder = decoders.ByteLevel()
        self._add_special = False
        self._vocab = self._tk.get_vocab(with_added_tokens=True)
        self.eod_id = self._vocab.get(GPT2_EOD)
        self._control, self._plain = {}, {}  # no added tokens: <|endoftext|> in text is text
        self._encode = getattr(self._tk, "encode_batch_fast", self._tk.encode_batch)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens and self.eod_id is not None:  # the end of document is GPT-2's special token
            ids = [i for i in ids if int(i) != self.eod_id]
        return super().decode(ids)

    def checksum(self) -> str:
        h = hashlib.sha256()
        for path in (self.path, self.merges_path):
            h.update(file_sha256(path).encode())
        return h.hexdigest()

    def describe(self) -> dict:
        return {**super().describe(), "merges_path": str(self.merges_path)}


def _prepend_never(spec) -> None:
    """Metaspace pre-tokenizers inside ``spec`` (a tokenizer.json pre_tokenizer, possibly a Sequence) that add
    their prefix space at the start of the input only: made to add none."""
    if isinstance(spec, dict):
        if spec.get("type") == "Metaspace" and spec.get("prepend_scheme") == "first":
            spec["prepend_scheme"] = "never"
        for value in spec.values():
            _prepend_never(value)
    elif isinstance(spec, list):
        for value in spec:
            _prepend_never(value)


def gpt2_merges_for(vocab: Path) -> Path | None:
    """The merges file that goes with a GPT-2 ``vocab.json``: ``merges.txt`` in a folder, else the sibling
    named like the vocab file (``gpt2-vocab.json`` -> ``gpt2-merges.txt``)."""
    if vocab.is_dir():
        candidate = vocab / "merges.txt"
    elif "vocab" in vocab.name:
        candidate = vocab.with_name(vocab.name.replace("vocab", "merges").removesuffix(".json") + ".txt")
    else:
        return None
    return candidate if candidate.is_file() else None


def detect_tokenizer_type(path: Path) -> str:
    if path.is_dir():
        if not (path / "tokenizer.json").exists() and (path / "vocab.json").is_file() \
                and (path / "merges.txt").is_file():
            return "gpt2-bpe"
        return "huggingface"
    if path.suffix == ".json":
        return "gpt2-bpe" if path.name != "tokenizer.json" and gpt2_merges_for(path) else "huggingface"
    return "sentencepiece"


def load_tokenizer(path: str | os.PathLike, tokenizer_type: str | None = None, *,
                   eod_token: str | None = None, add_special_tokens: bool = False,
                   merge_file: str | os.PathLike | None = None) -> Tokenizer:
    """Open ``path`` (SentencePiece ``.model``, ``tokenizer.json`` or a folder holding one, GPT-2
    ``vocab.json`` or a folder holding ``vocab.json`` + ``merges.txt``).

    ``eod_token`` (a token string) overrides the end-of-document id the library reports. ``merge_file``
    names the GPT-2 merges file (and makes the type ``gpt2-bpe``) when it is not next to the vocabulary.
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"tokenizer {path} not found; pass a SentencePiece .model, a tokenizer.json or its folder, "
                        "or a GPT-2 vocab.json (with --merge-file)")
    kind = tokenizer_type or ("gpt2-bpe" if merge_file is not None else detect_tokenizer_type(path))
    if kind == "sentencepiece":
        if path.is_dir():
            raise TokenizerError(f"{path} is a folder; a SentencePiece tokenizer is one .model file")
        tok: Tokenizer = SentencePieceTokenizer(path)
    elif kind == "huggingface":
        tok = HuggingFaceTokenizer(path, add_special_tokens=add_special_tokens)
    elif kind == "gpt2-bpe":
        tok = GPT2BPETokenizer(path, Path(merge_file) if merge_file is not None else None)
    else:
        raise TokenizerError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if eod_token is not None:
        token_id = tok.token_id(eod_token)
        if token_id is None:
            raise TokenizerError(f"--eod-token {eod_token!r} is not a token of {path}")
        tok.eod_id = token_id
    return tok
