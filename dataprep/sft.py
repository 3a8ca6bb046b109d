"""`mmtrain-prep sft`: chat / instruction JSONL -> chat-template tokens + a loss mask, as indexed datasets.

Writes ``PREFIX.bin/.idx`` (tokens, one document per conversation) and ``PREFIX_loss_mask.bin/.idx`` (uint8,
the same lengths: 1 where the token carries the loss), or with ``--preference`` the pairs
``PREFIX_chosen`` / ``PREFIX_rejected`` and their ``_loss_mask`` companions (document ``i`` of each is record
``i``). Reading, worker pool, rejects log, output switch and manifest are `mmtrain-prep text`'s
(``dataprep.text``); `inspect` / `verify` work on PREFIX as for text and also show / check the masks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from dataprep.errors import PrepError
from dataprep.sft_encode import MASK_DTYPE, ChatBlockEncoder, ChatEncodeOptions, mask_key, output_keys
from dataprep.text import (_check_writable, available_cpus, describe_inputs, input_fields, run_fields,
                           write_indexed_outputs)
from dataprep.text_input import find_inputs
from dataprep.text_output import output_paths, print_summary, write_manifest
from mmtrain.core.chat_template import BUILTIN_TEMPLATES, check_template_tokens, load_chat_template
from mmtrain.core.indexed import token_dtype_for
from mmtrain.core.tokenizer import TOKENIZER_TYPES, load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst), globs, or folders of them: OpenAI 'messages', "
                        "ShareGPT 'conversations', or 'prompt'+'completion' records (with --preference: 'prompt', "
                        "'chosen', 'rejected')")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin/.idx + PREFIX_loss_mask.bin/.idx + PREFIX.manifest.json (--preference: "
                        "PREFIX_chosen*, PREFIX_rejected*)")
    p.add_argument("--tokenizer", required=True,
                   help="Hugging Face tokenizer.json or its folder, or a SentencePiece .model (the folder's "
                        "tokenizer_config.json gives the chat template, bos/eos)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="override the type detected from --tokenizer")
    p.add_argument("--merge-file", default=None, metavar="MERGES", help="GPT-2 merges.txt (type gpt2-bpe)")
    p.add_argument("--chat-template", default="tokenizer", metavar="NAME",
                   help=f"'tokenizer' (its own Jinja template, default), a built-in ({', '.join(BUILTIN_TEMPLATES)}), "
                        "a .jinja file, or 'none' (prompt+completion records as plain text)")
    p.add_argument("--parse-special-in-content", action="store_true",
                   help="let message text hold the tokenizer's control tokens (a message's '<|im_start|>' becomes "
                        "that token, i.e. template structure); default: message text is plain text")
    p.add_argument("--preference", action="store_true",
                   help="preference pairs (prompt, chosen, rejected) for DPO instead of SFT conversations")
    p.add_argument("--loss-on", choices=("assistant", "all"), default="assistant",
                   help="which tokens carry the loss: the trained assistant turns (default) or every token")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="reject conversations longer than N tokens (e.g. data.seq_length + 1)")
    p.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-sequence id to every conversation (carries the loss)")
    p.add_argument("--eod-token", default=None, metavar="TOKEN",
                   help="use this token as end-of-sequence instead of the tokenizer's eos")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (default: all CPUs; 0 = encode in this process)")
    p.add_argument("--threads-per-worker", type=int, default=None, metavar="T",
                   help="tokenizer threads inside each worker (default: CPUs / workers)")
    p.add_argument("--block-mb", type=float, default=1.0, help="MB of JSONL per work unit (default 1)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of rejecting it")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar (default: only on a terminal)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.workers is not None and args.workers < 0:
        raise PrepError("--workers must be 0 or more")
    if args.max_length is not None and args.max_length < 1:
        raise PrepError("--max-length must be 1 or more")
    prefix = os.fspath(args.output_prefix)
    keys = output_keys(args.preference)
    prefixes = {k: prefix if k == "tokens" else f"{prefix}_{k}" for k in keys}
    files, skipped = find_inputs(args.input, exclude=output_paths(prefix, list(prefixes.values())))
    tables = [str(f.path) for f in files if f.kind != "jsonl"]
    if tables:  # conversations are nested records: JSONL only
        raise PrepError(f"mmtrain-prep sft reads JSONL conversations; {tables[0]} is a table (Parquet/Arrow): "
                        "write it as JSONL, or pass only .jsonl inputs")
    _check_writable(prefix)
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_type, eod_token=args.eod_token,
                               merge_file=args.merge_file)
    tokenizer.encode_batch_with_offsets(["check"])  # a tokenizer without offsets fails here, with its fix
    if args.append_eod and tokenizer.eod_id is None:
        raise PrepError(f"--append-eod: tokenizer {args.tokenizer} defines no end-of-sequence token; "
                        "name one with --eod-token")
    template = None if args.chat_template == "none" else load_chat_template(args.chat_template, args.tokenizer)
    if template is not None:
        check_template_tokens(template, tokenizer, args.tokenizer)
    dtype = token_dtype_for(tokenizer.max_id)
    cpus = available_cpus()
    workers = cpus if args.workers is None else args.workers
    threads = args.threads_per_worker or max(1, cpus // max(workers, 1))
    options = ChatEncodeOptions(str(args.tokenizer), tokenizer.type, template, args.preference, args.loss_on,
                                args.max_length, args.append_eod, tokenizer.eod_id, dtype.name, threads,
                                str(tokenizer.merges_path) if tokenizer.type == "gpt2-bpe" else None,
                                args.parse_special_in_content)
    outputs_spec = {k: (p, np.dtype(MASK_DTYPE) if k.endswith("loss_mask") else dtype) for k, p in prefixes.items()}
    state, writers, rejects_file = write_indexed_outputs(args, prefix, files, outputs_spec, options, workers,
                                                         tokenizer, ChatBlockEncoder, "prep sft")
    elapsed = time.monotonic() - started
    counts = state.counts()
    assert counts["read"] == counts["written"] + counts["empty"] + counts["rejected"], counts
    outputs = {key: w.summary() for key, w in writers.items()}
    token_keys = [k for k in keys if not k.endswith("loss_mask")]
    loss_tokens = {k: _ones(writers[mask_key(k)]) for k in token_keys}
    write_manifest(prefix, {
        "command": "mmtrain-prep sft",
        "argv": sys.argv[1:],
        **input_fields(files, skipped),
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "chat_template": template.describe() if template is not None else None,
        "kind": "preference" if args.preference else "sft",
        "loss_on": args.loss_on,
        "parse_special_in_content": args.parse_special_in_content,
        "max_length": args.max_length,
        "append_eod": args.append_eod,
        "eod_id": tokenizer.eod_id,
        "loss_masks": {k: mask_key(k) for k in token_keys},
        "outputs": outputs,
        "documents": counts,
        "loss_tokens": loss_tokens,
        **run_fields(state, rejects_file, workers, threads, elapsed),
    })
    print_summary("mmtrain-prep sft", counts, state.tokens, state.text_bytes, elapsed,
                  [f"{prefixes[k]}.bin/.idx ({outputs[k]['documents']:,} conversations, {dtype.name}; "
                   f"{loss_tokens[k]:,} loss tokens in {prefixes[mask_key(k)]})" for k in token_keys]
                  + [f"{prefix}.manifest.json"], rejects_file,
                  inputs=describe_inputs(files, skipped))
    for line in state.warning_lines("mmtrain-prep sft"):
        print(line, file=sys.stderr)
    return 0


def _ones(writer) -> int:
    """Loss tokens in a committed mask output (its .bin holds one 0/1 byte per token)."""
    if not writer.tokens:
        return 0
    return int(np.memmap(writer.bin_path, np.uint8, mode="r").sum(dtype=np.int64))
