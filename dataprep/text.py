"""`mmtrain-prep text`: JSONL (.jsonl, .gz, .zst), Parquet or ``datasets.save_to_disk`` folders -> tokens ->
Megatron-compatible ``PREFIX.bin/.idx``.

Pipeline: this process streams the inputs as ~1 MB blocks of whole lines (``text_input``) or of table rows
(``text_tables``: the key columns only, a Parquet row group at a time), worker
processes parse and batch-encode each block (``text_encode``), and this process writes the results in
input order (``mmtrain.core.indexed``). At most a few blocks per worker are in flight, so memory stays
flat on inputs of any size. Outputs appear only when complete (``text_output`` has the protocol).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from dataprep.errors import PrepError
from dataprep.progress import add_progress_argument, progress_enabled
from dataprep.text_encode import BlockEncoder, EncodedBlock, EncodeOptions, encode_in_worker, excerpt, init_worker
from dataprep.text_input import Truncated, describe_skipped, find_inputs, stream_inputs
from dataprep.text_output import (RejectLog, failed_rejects_path, human_rate, key_prefixes, manifest_path,
                                  output_paths, print_summary, rejects_path, replace_outputs, write_manifest)
from dataprep.text_tables import describe_row, preload
from mmtrain.core.indexed import IndexedDatasetWriter, token_dtype_for
from mmtrain.core.tokenizer import TOKENIZER_TYPES, load_tokenizer


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst), Parquet files (.parquet), datasets "
                        "save_to_disk folders, globs, or folders of them")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json (PREFIX_<key>.* for several keys)")
    p.add_argument("--tokenizer", required=True,
                   help="SentencePiece .model, Hugging Face tokenizer.json or a folder holding it, or GPT-2 "
                        "vocab.json or a folder holding vocab.json + merges.txt")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="override the type detected from --tokenizer")
    p.add_argument("--merge-file", default=None, metavar="MERGES",
                   help="GPT-2 merges.txt for a --tokenizer vocab.json that has none next to it (type gpt2-bpe)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSON keys (Parquet/Arrow: columns) to tokenize; several keys give one .bin/.idx pair "
                        "per key (default: text)")
    p.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-sequence id to every document")
    p.add_argument("--eod-token", default=None, metavar="TOKEN",
                   help="use this token as end-of-document instead of the tokenizer's eos")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="Hugging Face: let the tokenizer's post-processor add its special tokens (BOS, ...)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tokenizing worker processes (default: all CPUs; 0 = encode in this process)")
    p.add_argument("--threads-per-worker", type=int, default=None, metavar="T",
                   help="tokenizer threads inside each worker (default: CPUs / workers)")
    p.add_argument("--block-mb", type=float, default=1.0, help="MB of JSONL (or of table text) per work unit "
                                                               "(default 1)")
    p.add_argument("--keep-empty", action="store_true",
                   help="write documents with no tokens too (default: count and skip them)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of rejecting it")
    add_progress_argument(p)


def _progress_bar(total_bytes: int, mode: str, title: str = "prep text"):
    if not progress_enabled(mode):
        return None
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=title,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class _Run:
    """Counters and writers of one run; ``consume`` takes results in input order."""

    def __init__(self, args, files, writers: dict[str, IndexedDatasetWriter], rejects: RejectLog) -> None:
        self.args, self.files, self.writers, self.rejects = args, files, writers, rejects
        self.read = self.written = self.empty = self.rejected = self.blank = 0
        self.tokens = self.text_bytes = 0
        self.blocks = 0
        self.warnings: collections.Counter = collections.Counter()  # code -> written records warned about
        self.first_warning: dict[str, str] = {}  # code -> "FILE:LINE: reason" of its first record
        self.start = time.monotonic()

    def _reject(self, file_index: int, line: int, reason: str, excerpt: str, code: str,
                row_group: int | None = None, rows: int = 1) -> None:
        entry = self.files[file_index]
        path = str(entry.path)
        if entry.kind == "jsonl":
            where, named = {"line": line}, f"{path}:{line}"
        else:
            where, at = describe_row(entry.kind, line, row_group)
            named = f"{path}: {at}"
        if self.args.strict:
            raise PrepError(f"{named}: {reason} (--strict stops at the first bad record; "
                            "drop --strict to collect them in PREFIX.rejects.jsonl)")
        self.rejects.add(path, where, reason, excerpt, code, rows)
        self.rejected += rows

    def consume(self, item: EncodedBlock | Truncated) -> None:
        if isinstance(item, Truncated):
            self.read += item.rows
            self.files[item.file_index].records += item.rows
            self._reject(item.file_index, item.line, item.reason, excerpt(item.partial), item.code,
                         item.row_group, item.rows)
            return
        for r in item.rejects:
            self._reject(item.file_index, r.line, r.reason, r.excerpt, r.code, item.row_group)
        for w in item.warnings:
            self.warnings[w.code] += 1
            self.first_warning.setdefault(w.code, f"{self.files[item.file_index].path}:{w.line}: {w.reason}")
        for key, writer in self.writers.items():
            writer.add(item.tokens[key], item.lengths[key])
        self.read += item.records
        self.files[item.file_index].records += item.records
        self.written += item.written
        self.empty += item.empty
        self.blank += item.blank
        self.tokens += item.token_count
        self.text_bytes += item.text_bytes
        self.blocks += 1

    def rates(self) -> str:
        s = max(time.monotonic() - self.start, 1e-9)
        return (f"{human_rate(self.read, s, ' docs')}, {human_rate(self.text_bytes, s, 'B')}, "
                f"{human_rate(self.tokens, s, ' tok')}")

    def warning_lines(self, title: str) -> list[str]:
        """One line per warning code: how many written records, and the first one."""
        return [f"{title}: warning: {n:,} {code} record(s), e.g. {self.first_warning[code]}"
                for code, n in sorted(self.warnings.items())]

    def counts(self) -> dict:
        return {"read": self.read, "written": self.written, "empty": self.empty, "rejected": self.rejected,
                "blank_lines": self.blank}


def _pipeline(blocks, options, workers: int, tokenizer=None, encoder_class=BlockEncoder):
    """Encoded results in input order. ``workers`` processes, each with at most 4 blocks queued.
    ``tokenizer``: already loaded with ``options``; used here (workers=0) or inherited by forked workers.
    ``encoder_class(options, tokenizer).encode(block)`` does the work (``BlockEncoder`` for `text`)."""
    if workers == 0:
        encoder = encoder_class(options, tokenizer)
        for item in blocks:
            yield item if isinstance(item, Truncated) else encoder.encode(item)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # concurrent.futures rather than multiprocessing.Pool: a worker that dies (e.g. out of memory) raises
    # BrokenProcessPool here instead of leaving the run waiting forever.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                               initializer=init_worker,
                               # forked workers inherit the loaded tokenizer (fork pickles nothing)
                               initargs=(options, tokenizer if method == "fork" else None, encoder_class))
    try:
        pending: collections.deque = collections.deque()

        def next_result():
            head = pending.popleft()
            if isinstance(head, Truncated):
                return head
            try:
                return head.result()
            except BrokenProcessPool:
                raise PrepError("a tokenizer worker process died (out of memory? killed?); "
                                "try fewer --workers or a smaller --block-mb") from None

        for item in blocks:
            pending.append(item if isinstance(item, Truncated) else pool.submit(encode_in_worker, item))
            while len(pending) > 4 * workers:
                yield next_result()
        while pending:
            yield next_result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _unwritable(prefix: str, exc: OSError) -> PrepError:
    return PrepError(f"cannot write the output {prefix}: {exc.filename or prefix}: {exc.strerror or exc}; "
                     "choose an --output-prefix in a folder you can write to (with free space)")


def _check_writable(prefix: str) -> None:
    """Fail early, and without creating anything, when PREFIX's folder cannot be written: try a temporary file
    in the nearest folder that exists (a missing folder is made later, when the outputs are written)."""
    folder = Path(prefix).absolute().parent
    while not folder.exists():
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(folder))
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise _unwritable(prefix, exc) from None


def write_indexed_outputs(args, prefix: str, files, outputs: dict[str, tuple[str, np.dtype]], options,
                          workers: int, tokenizer, encoder_class=BlockEncoder, title: str = "prep text",
                          table_keys: tuple[str, ...] = ()):
    """Stream ``files`` through the encoder pool into one ``.bin/.idx`` writer per output key
    (``outputs``: key -> (data prefix, dtype)) and switch PREFIX over to the new complete set (the caller
    writes the manifest next). Returns (counters, writers, rejects file or None). Shared by `text` and `sft`:
    ``args`` brings ``strict``, ``block_mb`` and ``progress``; ``table_keys``: the columns read from Parquet /
    Arrow inputs (JSONL files are read whole)."""
    # Everything is written beside a complete earlier output of PREFIX, which stays until the new one is
    # complete (replace_outputs); a run that fails, is killed or writes nothing leaves it as it was.
    writers: dict[str, IndexedDatasetWriter] = {}
    prefixes = {k: p for k, (p, _) in outputs.items()}
    rejects: RejectLog | None = None
    bar = _progress_bar(sum(f.size for f in files), args.progress, title)
    results = None
    try:
        rejects = RejectLog(prefix)
        for key, (p, dtype) in outputs.items():
            writers[key] = IndexedDatasetWriter(p, dtype)
        state = _Run(args, files, writers, rejects)
        blocks = stream_inputs(files, table_keys, int(args.block_mb * (1 << 20)),
                               on_progress=bar.update if bar is not None else None)
        results = _pipeline(blocks, options, workers, tokenizer, encoder_class)
        for result in results:
            state.consume(result)
            if bar is not None:
                bar.set_postfix_str(state.rates(), refresh=False)
        for w in writers.values():
            w.finish()
        problem = _nothing_written(state, writers, prefixes)
        if problem:
            for w in writers.values():
                w.abort()
            # the rejects are this failed run's; a complete earlier output keeps its own rejects log
            where = failed_rejects_path(prefix) if manifest_path(prefix).exists() else rejects_path(prefix)
            where = rejects.commit_to(where)
            raise PrepError(f"{problem}; nothing was written" + (f"; see {where}" if where else ""))
        rejects_file = replace_outputs(prefix, writers.values(), rejects)
    except BaseException as exc:
        for w in writers.values():
            w.abort()
        if rejects is not None:
            rejects.abort()
        if isinstance(exc, OSError):
            raise _unwritable(prefix, exc) from None
        raise
    finally:
        if results is not None:
            results.close()  # stops the worker pool now, also on error
        if bar is not None:
            bar.close()
    return state, writers, rejects_file


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    keys = tuple(args.json_keys)
    if len(set(keys)) != len(keys):
        raise PrepError(f"--json-keys lists a key twice: {' '.join(keys)}")
    if args.workers is not None and args.workers < 0:
        raise PrepError("--workers must be 0 or more")
    prefix = os.fspath(args.output_prefix)
    prefixes = key_prefixes(prefix, keys)
    files, skipped = find_inputs(args.input, exclude=output_paths(prefix, list(prefixes.values())))
    _check_writable(prefix)  # before the tokenizer loads and workers start
    if any(f.kind != "jsonl" for f in files):
        preload()  # before the workers fork: they share it
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_type, eod_token=args.eod_token,
                               add_special_tokens=args.add_special_tokens, merge_file=args.merge_file)
    if args.append_eod and tokenizer.eod_id is None:
        raise PrepError(f"--append-eod: tokenizer {args.tokenizer} defines no end-of-sequence token; "
                        "name one with --eod-token")
    dtype = token_dtype_for(tokenizer.max_id)
    cpus = available_cpus()
    workers = cpus if args.workers is None else args.workers
    threads = args.threads_per_worker or max(1, cpus // max(workers, 1))
    options = EncodeOptions(str(tokenizer.path if tokenizer.type == "sentencepiece" else args.tokenizer),
                            tokenizer.type, args.eod_token, args.add_special_tokens, keys, args.append_eod,
                            tokenizer.eod_id, args.keep_empty, dtype.name, threads,
                            str(tokenizer.merges_path) if tokenizer.type == "gpt2-bpe" else None)

    state, writers, rejects_file = write_indexed_outputs(
        args, prefix, files, {k: (p, dtype) for k, p in prefixes.items()}, options, workers, tokenizer,
        table_keys=keys)

    elapsed = time.monotonic() - started
    counts = state.counts()
    assert counts["read"] == counts["written"] + counts["empty"] + counts["rejected"], counts
    outputs = {key: w.summary() for key, w in writers.items()}
    write_manifest(prefix, {
        "command": "mmtrain-prep text",
        "argv": sys.argv[1:],
        **input_fields(files, skipped),
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "json_keys": list(keys),
        "append_eod": args.append_eod,
        "eod_id": tokenizer.eod_id if args.append_eod else None,
        "keep_empty": args.keep_empty,
        "outputs": outputs,
        "documents": counts,
        **run_fields(state, rejects_file, workers, threads, elapsed),
    })
    print_summary("mmtrain-prep text", counts, state.tokens, state.text_bytes, elapsed,
                  [f"{p}.bin/.idx ({outputs[k]['documents']:,} docs, {dtype.name})" for k, p in prefixes.items()]
                  + [f"{prefix}.manifest.json"], rejects_file,
                  inputs=describe_inputs(files, skipped))
    return 0


def run_fields(state: _Run, rejects_file, workers: int, threads: int, elapsed: float) -> dict:
    """The manifest fields every prep run of indexed outputs records about itself (`text` and `sft`)."""
    return {"rejects_by_code": dict(sorted(state.rejects.codes.items())),
            "warnings_by_code": dict(sorted(state.warnings.items())), "tokens": state.tokens,
            "bytes": state.text_bytes, "rejects_file": rejects_file.name if rejects_file else None,
            "workers": workers, "threads_per_worker": threads, "elapsed_s": round(elapsed, 3)}


def input_fields(files, skipped) -> dict:
    """The manifest's record of the inputs taken (with their checksums) and skipped (with why)."""
    return {"inputs": [{"path": str(f.path), "size": f.size, "sha256": f.sha256, "records": f.records,
                        "text_bytes": f.bytes_read} for f in files],
            "skipped_inputs": [{"path": str(s.path), "reason": s.reason} for s in skipped]}


def describe_inputs(files, skipped) -> str:
    """The summary's line about the inputs taken (the first three named) and skipped."""
    taken = ", ".join(str(f.path) for f in files[:3]) + (f", ... {len(files) - 3} more" if len(files) > 3 else "")
    return f"{len(files)} input file(s): {taken}" + (f"; skipped {describe_skipped(skipped)}" if skipped else "")


def _nothing_written(state: _Run, writers: dict[str, IndexedDatasetWriter], prefixes: dict[str, str]) -> str | None:
    """Why this run's output would be unusable, or None. A .bin without tokens cannot be memory-mapped
    (megatron-core: "cannot mmap an empty file"), so zero documents -- or a key with no tokens at all --
    is a failed run, not an empty dataset."""
    if state.read == 0:
        return "no documents written: the inputs hold no records (only blank lines)"
    if state.written == 0:
        parts = [state.rejects.summary()] if state.rejected else []
        if state.empty:
            parts.append(f"{state.empty:,} empty (no tokens; --keep-empty writes them)")
        return f"no documents written: {state.read:,} read, {', '.join(parts)}"
    for key, w in writers.items():
        if w.tokens == 0:
            return (f"no tokens for key {key!r} in any of the {w.documents:,} documents: an empty "
                    f"{prefixes[key]}.bin cannot be memory-mapped by readers")
    return None
