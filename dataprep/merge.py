"""`mmtrain-prep merge OUT PREFIX...`: concatenate indexed datasets, in the order given, into OUT.bin/.idx.

Tokens are copied in large chunks straight from the memory-mapped sources (no per-document Python work).
Sources must share a tokenizer (by checksum, when their manifests say) unless --allow-mixed-tokenizers;
mixed token dtypes are widened to int32. OUT appears atomically with OUT.manifest.json listing the sources.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dataprep.errors import PrepError
from dataprep.text_output import print_summary, replace_outputs, write_manifest
from dataprep.text_tools import resolve_targets
from mmtrain.core.indexed import IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from mmtrain.core.tokenizer import file_sha256

_CHUNK_TOKENS = 32 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", metavar="OUT", help="output prefix: writes OUT.bin, OUT.idx, OUT.manifest.json")
    p.add_argument("inputs", nargs="+", metavar="PREFIX", help="indexed datasets to concatenate, in order")
    p.add_argument("--allow-mixed-tokenizers", action="store_true",
                   help="merge even when the sources' manifests name different tokenizers")


def _open_sources(prefixes: list[str]):
    sources = []
    for prefix in prefixes:
        targets = resolve_targets(prefix)
        if len(targets) != 1:
            names = ", ".join(t.data_prefix for t in targets)
            raise PrepError(f"{prefix} holds several key datasets ({names}); merge them one key at a time")
        t = targets[0]
        try:
            ds = IndexedDataset(t.data_prefix)
        except IndexedFormatError as exc:
            raise PrepError(str(exc)) from None
        if t.manifest is None:
            print(f"merge: warning: {t.data_prefix} has no manifest (incomplete run or another tool's output)",
                  file=sys.stderr)
        sources.append((t, ds))
    return sources


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out = str(args.output)
    if any(str(p) == out for p in args.inputs):
        raise PrepError(f"OUT {out} is also an input; choose a new prefix")
    sources = _open_sources([str(p) for p in args.inputs])
    tokenizers = {(t.manifest or {}).get("tokenizer", {}).get("sha256") for t, _ in sources if t.manifest}
    tokenizers.discard(None)
    if len(tokenizers) > 1 and not args.allow_mixed_tokenizers:
        raise PrepError("the sources were tokenized with different tokenizers (manifest checksums differ); "
                        "pass --allow-mixed-tokenizers if that is really intended")
    dtypes = {ds.dtype for _, ds in sources}
    dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.int32)
    with IndexedDatasetWriter(out, dtype) as writer:  # beside a complete earlier OUT, which stays until the end
        for _, ds in sources:
            begin = 0
            while begin < len(ds):
                # as many whole documents as fit in one chunk (at least one)
                ends = np.cumsum(ds.lengths[begin:begin + (1 << 20)], dtype=np.int64)
                stop = begin + max(1, int(np.searchsorted(ends, _CHUNK_TOKENS, side="right")))
                writer.add(ds.tokens_of_range(begin, stop).astype(dtype, copy=False), ds.lengths[begin:stop])
                begin = stop
        writer.finish()
        replace_outputs(out, [writer], None)
    first_tok = next((t.manifest.get("tokenizer") for t, _ in sources if t.manifest), None)
    total = sum(ds.num_documents for _, ds in sources)
    elapsed = time.monotonic() - start
    counts = {"read": total, "written": total, "empty": 0, "rejected": 0}
    write_manifest(out, {
        "command": "mmtrain-prep merge", "argv": sys.argv[1:],
        "sources": [{"prefix": t.data_prefix, "documents": ds.num_documents, "tokens": ds.num_tokens,
                     "dtype": ds.dtype.name, "idx_sha256": file_sha256(ds.idx_path),
                     "manifest_created": (t.manifest or {}).get("created")} for t, ds in sources],
        "tokenizer": first_tok if len(tokenizers) <= 1 else None,
        "dtype": dtype.name,
        "outputs": {"merged": writer.summary()},
        "documents": counts,
        "tokens": writer.tokens,
        "elapsed_s": round(elapsed, 3),
    })
    print_summary("mmtrain-prep merge", counts, writer.tokens, writer.tokens * dtype.itemsize, elapsed,
                  [f"{out}.bin/.idx ({writer.documents:,} docs, {dtype.name})", f"{out}.manifest.json"], None)
    return 0
