"""The tokenizer files of an HF export: ``tokenizer.json`` + ``tokenizer_config.json`` and
``generation_config.json``, so ``transformers.pipeline("text-generation", model=DIR)`` needs nothing else.

Any tokenizer ``mmtrain-prep`` reads becomes a fast (``tokenizers``) tokenizer: a ``tokenizer.json`` as it is, a
GPT-2 ``vocab.json`` + ``merges.txt`` as the byte-level BPE mmtrain builds from them, a SentencePiece ``.model``
through transformers' own SentencePiece conversion (its normalizer, byte fallback and pieces read from the
model) with a decoder that follows SentencePiece's rule for leading spaces (``_sentencepiece_decoder``). The
converted tokenizer must encode a set of probe texts exactly as the original does (the ids the model was
trained on) and decode them alike, else the export stops with a one-line error instead of writing a tokenizer
that disagrees.
Special-token strings inside text are split like plain text for SentencePiece exports (as ``mmtrain-prep``
encoded them), and parsed as the tokenizer.json says otherwise (as its library does).

Which tokenizer: the ``--tokenizer`` given, else the one the checkpoint names (its complete.json's record, or
for an older checkpoint the manifest of its first data prefix; checked by its SHA-256), else none (weights only,
with a note).

What the tokenizer's folder says about chat goes along: the chat template (``chat_template.jinja``, or
``chat_template`` in its ``tokenizer_config.json``; of named templates the ``default``) and the special tokens that config lists
(``extra_special_tokens`` / ``additional_special_tokens``, e.g. chatml's ``<|im_start|>``, ``<|im_end|>`` from
``mmtrain-prep train-tokenizer --chat-template chatml``), marked special in the export with their ids unchanged."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mmtrain.core.manifest import ManifestError
from mmtrain.core.tokenizer import GPT2_EOD, Tokenizer, TokenizerError, listed_special_tokens, load_tokenizer
from mmtrain.core.tokenizer_record import PROBE_TEXTS, checkpoint_tokenizer_record

# transformers' bookkeeping keys that say nothing about the tokenizer
_DROP_CONFIG_KEYS = ("is_local", "local_files_only", "name_or_path")


class TokenizerExportError(ValueError):
    """A tokenizer that cannot be exported faithfully; the message names the file."""


def recorded_tokenizer(meta: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer a checkpoint names (``meta``: its complete.json; ``mmtrain.core.tokenizer_record``), when it
    is still there with the recorded checksum; None when the checkpoint names none."""
    try:
        found = checkpoint_tokenizer_record(meta)
    except ManifestError as exc:
        raise TokenizerExportError(f"{exc} (or pass --tokenizer)") from None
    if found is None:
        return None
    rec, where = found
    path = rec["path"]
    try:
        merges = rec.get("merges_path") if isinstance(rec.get("merges_path"), str) else None
        tok = load_tokenizer(path, rec.get("type") if isinstance(rec.get("type"), str) else None, merge_file=merges)
    except TokenizerError as exc:
        raise TokenizerExportError(f"{where} names tokenizer {path}: {exc}; pass --tokenizer PATH (or "
                                   "--no-tokenizer)") from None
    sha = rec.get("sha256")
    if isinstance(sha, str) and tok.checksum() != sha:
        raise TokenizerExportError(f"{path} changed since the model's data was prepared with it (its checksum "
                                   f"differs from {where}); pass the tokenizer the data was made with as --tokenizer")
    return tok


def _hf_fast_tokenizer(tok: Tokenizer):
    """A transformers fast tokenizer equal to ``tok``."""
    try:
        import transformers
    except ImportError:
        raise TokenizerExportError("exporting the tokenizer needs transformers (pip install 'mmtrain[eval]'), or "
                                   "export without it: --no-tokenizer") from None

    path = Path(tok.path)
    if tok.type == "sentencepiece":
        with tempfile.TemporaryDirectory(prefix="mmtrain-spm-") as tmp:
            (Path(tmp) / "tokenizer.model").write_bytes(path.read_bytes())
            (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "split_special_tokens": True}))
            try:
                return transformers.AutoTokenizer.from_pretrained(tmp)
            except Exception as exc:  # noqa: BLE001 - the conversion's own errors name no file
                raise TokenizerExportError(f"{path}: transformers cannot convert this SentencePiece model "
                                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                                           ) from None
    if tok.type == "gpt2-bpe":  # the tokenizers object mmtrain encodes with (transformers 5 reads no vocab files)
        ends = {} if tok.eod_id is None else {"bos_token": GPT2_EOD, "eos_token": GPT2_EOD}
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, split_special_tokens=True, **ends)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok.path))


# SentencePiece decoding as tokenizers decoders: the '▁' that opens a piece becomes this mark (a Unicode
# noncharacter, for internal use) so that only a piece's own leading '▁' can be dropped at the start of the text
_MARKS = [chr(c) for c in range(0xFDD0, 0xFDF0)]
_ALL = 2**31 - 1  # Strip's count: every mark at the start of the text


def _sentencepiece_decoder(tok: Tokenizer):
    """A tokenizers decoder that decodes ids as SentencePiece does (``docs/convert-hf.md`` lists the exceptions).

    SentencePiece turns '▁' into a space and, when it adds a dummy prefix or collapses whitespace, drops the
    '▁' that opens the first piece (collapsing: of every piece while the text is still empty, so leading '▁'
    pieces vanish). Byte-fallback pieces are text of their own: a space byte or a '▁' character from bytes is
    never dropped or replaced. (transformers' conversion strips one space from the start of the whole text
    instead: wrong after a standalone '▁' piece when whitespace is collapsed, and for a leading space byte.)"""
    from tokenizers import Regex, decoders
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:  # it needs protobuf, as transformers' conversion does
        raise TokenizerExportError(f"{tok.path}: reading the SentencePiece model's settings needs protobuf "
                                   f"({exc}); pip install protobuf, or export with --no-tokenizer") from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tok.path).read_bytes())
    if proto.denormalizer_spec.precompiled_charsmap:
        raise TokenizerExportError(f"{tok.path}: this SentencePiece model rewrites decoded text with a "
                                   "denormalization rule, which a tokenizer.json decoder cannot apply; export with "
                                   "--no-tokenizer and ship the .model")
    spec = proto.normalizer_spec
    spaces = decoders.Replace("▁", " ")
    if not (spec.add_dummy_prefix or spec.remove_extra_whitespaces):  # nothing is dropped
        return decoders.Sequence([spaces, decoders.ByteFallback(), decoders.Fuse()])
    pieces = [p.piece for p in proto.pieces]
    mark = next((m for m in _MARKS if not any(m in p for p in pieces)), None)
    if mark is None:
        raise TokenizerExportError(f"{tok.path}: its pieces hold every character U+FDD0..U+FDEF, one of which the "
                                   "exported decoder needs as a mark; export with --no-tokenizer")
    opening = decoders.Replace(Regex("\\A▁"), mark)  # per token, before the byte pieces become text
    if not spec.remove_extra_whitespaces:
        # the first piece's only: Metaspace drops the mark in the first token and makes it a space elsewhere
        return decoders.Sequence([opening, spaces, decoders.Metaspace(replacement=mark, prepend_scheme="first",
                                                                       split=False),
                                  decoders.ByteFallback(), decoders.Fuse()])
    # every piece's while the text is empty: the marks at the start of the whole text
    return decoders.Sequence([opening, spaces, decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(content=mark, left=_ALL, right=0), decoders.Replace(mark, " ")])


def _folder_chat_template(tok: Tokenizer) -> str | None:
    """The chat template of ``tok``'s folder (``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json``: the files mmtrain-prep sft and mmtrain.serve read), or None."""
    folder = Path(tok.path).parent
    config_path = folder / "tokenizer_config.json"
    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TokenizerExportError(f"{folder}: tokenizer files unreadable ({exc}); fix them or export with "
                                   "--no-tokenizer") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one, as mmtrain-prep sft and serve take it
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise TokenizerExportError(f"{config_path}: chat_template is neither a string nor a list of named "
                                   "templates; fix it or export with --no-tokenizer")
    return template


def _carry_chat_files(hf_tok, tok: Tokenizer) -> list[str]:
    """Put the folder's chat template and special tokens into ``hf_tok``; the special tokens (to probe)."""
    template = _folder_chat_template(tok)
    try:
        special = listed_special_tokens(Path(tok.path).parent)
    except TokenizerError as exc:
        raise TokenizerExportError(f"{exc}; or export with --no-tokenizer") from None
    missing = [t for t in special if tok.token_id(t) is None]
    if missing:
        raise TokenizerExportError(f"{Path(tok.path).parent / 'tokenizer_config.json'} lists special token(s) "
                                   f"{', '.join(missing)} that {tok.path} does not have as single tokens; remove them "
                                   "from the config (or retrain with mmtrain-prep train-tokenizer --special-tokens)")
    new = [t for t in special if t not in hf_tok.all_special_tokens]
    if new:
        hf_tok.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    if template is not None:
        hf_tok.chat_template = template
    return special


def _check_same_ids(hf_tok, tok: Tokenizer, chat_tokens: list[str] = ()) -> None:
    """The probes (and the folder's special tokens in text) encode to the same ids, and those ids (and each probe's
    ids after a standalone '▁') decode to the same text."""
    path = tok.path
    space = tok.token_id("▁") if tok.type == "sentencepiece" else None
    special = set(hf_tok.all_special_ids)
    probes = [*PROBE_TEXTS, *chat_tokens, "".join(f"{t}x {t}\n" for t in chat_tokens)] if chat_tokens else PROBE_TEXTS
    for text in probes:
        ours, theirs = tok.encode(text), hf_tok.encode(text, add_special_tokens=False)
        if ours != theirs:
            raise TokenizerExportError(f"{path}: the exported tokenizer encodes {text!r} as {theirs[:12]}, the "
                                       f"original as {ours[:12]}; this tokenizer cannot be exported faithfully "
                                       "(export with --no-tokenizer and ship it yourself)")
        for ids in (ours, [space] + ours) if space is not None else (ours,):
            # shown, special tokens (an <unk>) are names in transformers, not SentencePiece's text
            for skip in (True,) if special & set(ids) else (False, True):
                mine, exported = tok.decode(ids, skip_special_tokens=skip), hf_tok.decode(ids,
                                                                                         skip_special_tokens=skip)
                if mine != exported:
                    raise TokenizerExportError(f"{path}: the exported tokenizer decodes {ids[:12]} as {exported!r}, "
                                               f"the original as {mine!r}; this tokenizer cannot be exported "
                                               "faithfully (export with --no-tokenizer and ship it yourself)")


def open_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at ``path`` (anything ``mmtrain-prep --tokenizer`` takes), errors as one line."""
    try:
        return load_tokenizer(path)
    except TokenizerError as exc:
        raise TokenizerExportError(str(exc)) from None


def hf_tokenizer_files(tok: Tokenizer) -> tuple[dict[str, bytes], dict[str, Any]]:
    """(file name -> bytes of the HF tokenizer files, generation_config.json's content) for ``tok``."""
    hf_tok = _hf_fast_tokenizer(tok)
    if tok.type == "sentencepiece":
        hf_tok.backend_tokenizer.decoder = _sentencepiece_decoder(tok)
    eos = tok.eod_id
    if eos is not None and hf_tok.eos_token_id != eos:  # the end-of-document id the data was prepared with
        hf_tok.eos_token = hf_tok.convert_ids_to_tokens(eos)
    _check_same_ids(hf_tok, tok, _carry_chat_files(hf_tok, tok))
    with tempfile.TemporaryDirectory(prefix="mmtrain-tok-") as tmp:
        hf_tok.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    config = json.loads(files["tokenizer_config.json"])
    for key in _DROP_CONFIG_KEYS:
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5 both know this name
    config["clean_up_tokenization_spaces"] = False  # decode as mmtrain does ("a ." stays "a .")
    files["tokenizer_config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")
    generation = {"do_sample": False}
    if hf_tok.bos_token_id is not None:
        generation["bos_token_id"] = hf_tok.bos_token_id
    if eos is not None or hf_tok.eos_token_id is not None:
        generation["eos_token_id"] = eos if eos is not None else hf_tok.eos_token_id
        generation["pad_token_id"] = generation["eos_token_id"]  # no pad token: batched generation pads with EOS
    return files, generation
