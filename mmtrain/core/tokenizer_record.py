"""Which tokenizer a checkpoint's model was trained with, and whether another tokenizer is that one.

A *tokenizer record* is what ``Tokenizer.describe()`` gives and a data manifest stores under ``tokenizer``:
``type``, ``path``, ``sha256`` (of the file(s) that define it), ``vocab_size``, ``max_id``, ``eod_id``.
A checkpoint names its tokenizer in ``complete.json``'s ``tokenizer`` (training copies the record of its data's
manifests; ``hf-to-mmtrain`` records the HF folder's tokenizer); an older checkpoint through the manifest of its
run's first ``data.prefixes`` entry, when that is still there.

Two records name the same tokenizer when their checksums are equal, or when both files are still there as
recorded and encode a set of probe texts to the same ids (a faithful copy in another format, such as the
``tokenizer.json`` of an HF export of a SentencePiece-trained model). Used by ``mmtrain.evaluate``,
``mmtrain.generate`` and ``mmtrain.lm_eval`` to refuse data or a tokenizer that the model was not trained with
(equal vocabulary sizes hide it: the ids fit, the loss is just wrong).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmtrain.core.manifest import read_prefix_manifest
from mmtrain.core.tokenizer import Tokenizer, TokenizerError, load_tokenizer

# texts whose ids tell tokenizers apart: spaces, tabs, newlines, digits, non-ASCII, empty
PROBE_TEXTS = ["Hello world", " leading space", "two  spaces and\ttabs", "new\nline\n\n  indented code",
               "digits 1234567890", "Ünïcödé, ẞ, 你好, emoji 😀", "trailing ", "", "   ", "a\r\nb",
               "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # square"]


def checkpoint_tokenizer_record(meta: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(the tokenizer record of the checkpoint whose complete.json is ``meta``, where it was read), or None when
    the checkpoint names none (mock data, data without a manifest, an HF conversion without a tokenizer, a
    checkpoint older than the record whose data is gone). Raises ``ManifestError`` for an unreadable manifest."""
    run = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    prefixes = data.get("prefixes") if isinstance(data.get("prefixes"), list) else []
    prefixes = [p for p in prefixes if isinstance(p, str) and not _is_number(p)]
    own = meta.get("tokenizer")
    if isinstance(own, dict) and isinstance(own.get("path"), str):
        return _found_beside_data(own, prefixes), "complete.json"
    if not prefixes:
        return None
    manifest = read_prefix_manifest(prefixes[0]) or {}
    rec = manifest.get("tokenizer")
    if isinstance(rec, dict) and isinstance(rec.get("path"), str) and rec["path"]:
        return _found_beside_data(rec, prefixes), f"{prefixes[0]}.manifest.json"
    return None


def _found_beside_data(record: dict[str, Any], prefixes: list[str]) -> dict[str, Any]:
    """``record``, its path made to name the file where it is: a manifest records the tokenizer path as given to
    ``mmtrain-prep``, relative to where that ran (often the data folder), so a relative path that is not there
    from here is looked for in the run's data folders. The first such file is taken; callers check its checksum."""
    path = Path(record["path"])
    if path.is_absolute() or path.exists():
        return record
    for prefix in prefixes:
        beside = Path(prefix).parent / path
        if beside.exists():
            return {**record, "path": str(beside)}
    return record


def _is_number(text: str) -> bool:  # Megatron-style prefix lists interleave weights: "0.3 path 0.7 path"
    try:
        float(text)
        return True
    except ValueError:
        return False


def open_recorded(record: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer a record names, when its file is still there with the recorded checksum; else None."""
    merges = record.get("merges_path") if isinstance(record.get("merges_path"), str) else None
    kind = record.get("type") if isinstance(record.get("type"), str) else None
    try:
        tok = load_tokenizer(record["path"], kind, merge_file=merges)
    except (TokenizerError, OSError, KeyError, TypeError):
        return None
    sha = record.get("sha256")
    return tok if not isinstance(sha, str) or tok.checksum() == sha else None


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether records ``a`` and ``b`` name the same tokenizer (see the module docstring). Records without a
    checksum are compared by type and path."""
    sha_a, sha_b = a.get("sha256"), b.get("sha256")
    if sha_a and sha_b:
        if sha_a == sha_b:
            return True
    elif (a.get("type"), a.get("path")) == (b.get("type"), b.get("path")):
        return True
    if a.get("vocab_size") is not None and b.get("vocab_size") is not None and a["vocab_size"] != b["vocab_size"]:
        return False
    tok_a, tok_b = open_recorded(a), open_recorded(b)
    if tok_a is None or tok_b is None:
        return False
    return tok_a.encode_batch(PROBE_TEXTS) == tok_b.encode_batch(PROBE_TEXTS)


def tokenizer_mismatch(meta: dict[str, Any], given: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(the record of the tokenizer the checkpoint whose complete.json is ``meta`` names, where it was read) when
    ``given`` is another tokenizer; None when it is that one or the checkpoint names none."""
    found = checkpoint_tokenizer_record(meta)
    return None if found is None or same_tokenizer(found[0], given) else found


def describe_record(record: dict[str, Any]) -> str:
    """``sentencepiece tokenizer tok/sp.model (sha256 0123456789ab...)``, for messages."""
    return f"{record.get('type')} tokenizer {record.get('path')} (sha256 {str(record.get('sha256') or '?')[:12]}...)"
