"""`mmtrain-prep train-tokenizer`: a SentencePiece BPE or unigram model from JSONL, with byte fallback.

Documents are streamed from the inputs and reservoir-sampled (seeded, so the same inputs give the same
sample), then handed to SentencePiece line by line. Defaults make the model lossless for pretraining data:
byte fallback (any text -- emoji, rare scripts, control bytes -- encodes without ``<unk>``), identity
normalization and kept whitespace (indentation survives), so ``decode(encode(text)) == text``. ``PREFIX.model`` and ``PREFIX.vocab`` appear
atomically, with ``PREFIX.manifest.json`` recording what made them.

For chat data, ``--special-tokens`` makes strings such as ``<|im_start|>`` single tokens (SentencePiece
user-defined symbols: one id wherever the string occurs, as a chat template's text needs), and
``--chat-template chatml`` (or ``llama3``, or a ``.jinja`` file) adds the template's tokens and writes
``tokenizer_config.json`` next to the model with the template: ``mmtrain-prep sft``, ``mmtrain.serve`` and the
Hugging Face export read it from there, as they read a ``tokenizer.json`` folder's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dataprep.errors import PrepError
from dataprep.text_encode import EncodedBlock, parse_records
from dataprep.text_input import Truncated, expand_inputs, split_lines, stream_inputs
from dataprep.text_tables import TableBlock, describe_row, table_texts
from dataprep.text_output import write_manifest
from mmtrain.core.chat_template import BUILTIN_SPECIAL_TOKENS, BUILTIN_TEMPLATES, compile_template
from mmtrain.core.tokenizer import file_sha256
from mmtrain.utils.atomic import atomic_write_text, fsync_dir

# SentencePiece's own control pieces (unk_id=0, bos_id=1, eos_id=2 below): never user-defined symbols as well
_CONTROL_PIECES = ("<unk>", "<s>", "</s>")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="JSONL or Parquet files, datasets save_to_disk folders, globs or folders")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY", help="keys whose text is used")
    p.add_argument("--sample-docs", type=int, default=1_000_000, metavar="N",
                   help="train on a uniform random sample of at most N documents (default 1,000,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--no-byte-fallback", action="store_true", help="disable byte fallback (unknown -> <unk>)")
    p.add_argument("--normalization", default="identity",
                   help="SentencePiece normalization rule (default identity: decode(encode(text)) == text; "
                        "nmt_nfkc is SentencePiece's own default)")
    p.add_argument("--collapse-whitespace", action="store_true",
                   help="let SentencePiece drop leading/trailing and repeated spaces (lossy; off by default)")
    p.add_argument("--max-sentence-length", type=int, default=16384, help="bytes; longer lines are cut")
    p.add_argument("--threads", type=int, default=None, help="trainer threads (default: all CPUs)")
    p.add_argument("--special-tokens", action="append", default=[], metavar="TOK[,TOK...]",
                   help="strings that become single tokens wherever they occur (SentencePiece user-defined symbols), "
                        "comma-separated, repeatable, e.g. '<|im_start|>,<|im_end|>'; listed as special tokens in "
                        "tokenizer_config.json next to the model")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help=f"a built-in chat template ({', '.join(BUILTIN_TEMPLATES)}: its special tokens are added) or "
                        "a .jinja file (give its tokens with --special-tokens), written as chat_template into "
                        "tokenizer_config.json next to the model, where mmtrain-prep sft and mmtrain.serve find it")


def _sample(args) -> tuple[list[str], dict, list, list[str]]:
    """Reservoir sample of document texts; counts of what was read, skipped (bad) and sampled."""
    files = expand_inputs(args.input)
    rng = random.Random(args.seed)
    sample: list[str] = []
    counts = {"read": 0, "bad": 0}
    examples: list[str] = []
    keys = tuple(args.json_keys)

    def where(file_index: int, line: int, row_group: int | None = None) -> str:
        entry = files[file_index]
        return (f"{entry.path}:{line}" if entry.kind == "jsonl"
                else f"{entry.path}: {describe_row(entry.kind, line, row_group)[1]}")

    for item in stream_inputs(files, keys):
        if isinstance(item, Truncated):
            counts["bad"] += item.rows
            examples.append(f"{where(item.file_index, item.line, item.row_group)}: {item.reason}")
            continue
        if isinstance(item, TableBlock):
            texts, _, bad = table_texts(item, keys)
            counts["bad"] += len(bad)
            examples += [f"{where(item.file_index, item.first_row + i, item.row_group)}: {reason}"
                         for i, (_, reason, _) in list(bad.items())[:3]]
        else:
            out = EncodedBlock(item.file_index, item.first_line, len(item.data))
            texts, _ = parse_records(split_lines(item.data), item.first_line, keys, out)
            counts["bad"] += len(out.rejects)
            examples += [f"{where(item.file_index, r.line)}: {r.reason}" for r in out.rejects[:3]]
        for i in range(len(next(iter(texts.values())))):
            doc = "\n".join(texts[k][i] for k in args.json_keys)
            counts["read"] += 1
            if len(sample) < args.sample_docs:
                sample.append(doc)
            else:
                j = rng.randrange(counts["read"])
                if j < args.sample_docs:
                    sample[j] = doc
    return sample, counts, files, examples


def _special_tokens(args) -> list[str]:
    """--chat-template's tokens, then --special-tokens' (in order, each once)."""
    tokens = list(BUILTIN_SPECIAL_TOKENS.get(args.chat_template, ()))
    for option in args.special_tokens:
        for token in option.split(","):
            if not token or token != token.strip() or any(ch.isspace() for ch in token):
                raise PrepError(f"--special-tokens {option!r}: {token!r} is empty or holds whitespace; give "
                                "comma-separated tokens without spaces, e.g. '<|im_start|>,<|im_end|>'")
            if token in _CONTROL_PIECES:
                raise PrepError(f"--special-tokens: {token} is already SentencePiece's own control token; leave it out")
            if token not in tokens:
                tokens.append(token)
    return tokens


def _chat_template_text(name: str | None) -> str | None:
    if name is None:
        return None
    if name in BUILTIN_TEMPLATES:
        text = BUILTIN_TEMPLATES[name]
    elif Path(name).is_file():
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PrepError(f"--chat-template {name}: unreadable ({exc})") from None
    else:
        raise PrepError(f"--chat-template {name}: neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a "
                        "template file")
    compile_template(text)  # a syntax error is reported now, not by every later user of the tokenizer
    return text


def _write_tokenizer_config(folder: Path, template: str | None, special: list[str]) -> Path:
    """``tokenizer_config.json`` in the Hugging Face form (the keys mmtrain-prep sft, mmtrain.serve and the HF
    export read): the chat template, BOS/EOS/UNK strings (SentencePiece's own), the added special tokens."""
    config: dict = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "extra_special_tokens": special}
    if template is not None:
        config["chat_template"] = template
    return atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def run(args: argparse.Namespace) -> int:
    import sentencepiece as spm

    start = time.monotonic()
    if args.vocab_size < 8:
        raise PrepError("--vocab-size must be at least 8")
    special = _special_tokens(args)
    template = _chat_template_text(args.chat_template)
    sample, counts, files, examples = _sample(args)
    if counts["bad"]:
        print(f"train-tokenizer: skipped {counts['bad']:,} bad records (not used for training), e.g.:",
              file=sys.stderr)
        for line in examples[:5]:
            print(f"  {line}", file=sys.stderr)
    lines = [line for doc in sample for line in doc.split("\n") if line.strip()]
    if not lines:
        raise PrepError(f"no usable text under key(s) {', '.join(args.json_keys)} in {' '.join(args.input)}")
    prefix = Path(args.output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix=f".{prefix.name}.", dir=prefix.parent) as tmp:
        tmp_prefix = os.path.join(tmp, "sp")
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_prefix=tmp_prefix, vocab_size=args.vocab_size,
                model_type=args.model_type, byte_fallback=not args.no_byte_fallback,
                character_coverage=args.character_coverage, max_sentence_length=args.max_sentence_length,
                hard_vocab_limit=False, num_threads=threads, minloglevel=2,
                normalization_rule_name=args.normalization,
                remove_extra_whitespaces=args.collapse_whitespace,
                allow_whitespace_only_pieces=True, split_digits=True,
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=special)
        except RuntimeError as exc:
            raise PrepError(f"SentencePiece training failed: {exc}") from None
        for ext in (".model", ".vocab"):
            with open(tmp_prefix + ext, "rb") as f:
                os.fsync(f.fileno())
            shutil.move(tmp_prefix + ext, f"{prefix}{ext}")
    fsync_dir(prefix.parent)
    model = Path(f"{prefix}.model")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    config = _write_tokenizer_config(prefix.parent, template, special) if special or template is not None else None
    write_manifest(str(prefix), {
        "command": "mmtrain-prep train-tokenizer", "argv": sys.argv[1:],
        "inputs": [{"path": str(f.path), "size": f.size, "sha256": f.sha256} for f in files],
        "model": {"path": str(model), "sha256": file_sha256(model), "vocab_size": sp.get_piece_size(),
                  "model_type": args.model_type, "byte_fallback": not args.no_byte_fallback,
                  "normalization": args.normalization, "collapse_whitespace": args.collapse_whitespace,
                  "eos_id": sp.eos_id(), "bos_id": sp.bos_id(), "unk_id": sp.unk_id(),
                  "special_tokens": {t: sp.piece_to_id(t) for t in special}},
        "tokenizer_config": None if config is None else {
            "path": str(config), "sha256": file_sha256(config), "chat_template": args.chat_template},
        "documents": {"read": counts["read"], "bad": counts["bad"], "sampled": len(sample)},
        "lines_trained": len(lines), "seed": args.seed, "elapsed_s": round(time.monotonic() - start, 3)})
    print(f"train-tokenizer: {model} ({sp.get_piece_size()} pieces, {args.model_type}) from {len(sample):,} of "
          f"{counts['read']:,} documents in {time.monotonic() - start:.1f}s", file=sys.stderr)
    if config is not None:
        print(f"train-tokenizer: {config} ({len(special)} special tokens: {' '.join(special)}"
              f"{'; chat template ' + args.chat_template if template is not None else ''})", file=sys.stderr)
    return 0
