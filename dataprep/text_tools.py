"""`mmtrain-prep inspect PREFIX` and `mmtrain-prep verify PREFIX` for indexed (``.bin/.idx``) datasets.

PREFIX is what ``--output-prefix`` was: with several ``--json-keys`` it stands for all its
``PREFIX_<key>`` pairs; a ``PREFIX_<key>`` is accepted too. ``verify`` re-derives everything it can from
the files (header, sizes, pointer contiguity, document indices, ``.bin`` size) and then compares with the
manifest (sizes, counts, SHA-256 unless ``--no-checksums``). A pair without its manifest is reported as
incomplete: the manifest is written last, so its absence means the run did not finish.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataprep.errors import PrepError
from dataprep.text_output import manifest_path, read_manifest
from mmtrain.core.indexed import HEADER_SIZE, IndexedDataset, IndexedFormatError, idx_path
from mmtrain.core.tokenizer import file_sha256, load_tokenizer


@dataclass
class Target:
    data_prefix: str  # the .bin/.idx pair
    key: str | None  # its JSON key, when known from the manifest
    manifest: dict | None
    manifest_file: Path | None


def _load_manifest(prefix: str) -> dict | None:
    try:
        return read_manifest(prefix)
    except (OSError, ValueError) as exc:
        raise PrepError(f"{manifest_path(prefix)}: unreadable manifest ({exc})") from None


def resolve_targets(prefix: str) -> list[Target]:
    """The .bin/.idx pairs PREFIX stands for, each with the manifest that describes it (if any)."""
    manifest = _load_manifest(prefix)
    if manifest is not None and isinstance(manifest.get("outputs"), dict):
        outputs = manifest["outputs"]
        if len(outputs) > 1 or not idx_path(prefix).exists():
            parent = Path(prefix).parent
            return [Target(str(parent / Path(o["idx"]).with_suffix("")), k, manifest, manifest_path(prefix))
                    for k, o in outputs.items()]
        key = next(iter(outputs))
        return [Target(prefix, key, manifest, manifest_path(prefix))]
    if manifest is not None:  # e.g. a merge manifest: one pair
        return [Target(prefix, None, manifest, manifest_path(prefix))]
    # PREFIX_<key> of a multi-key run: its manifest sits at PREFIX
    name = Path(prefix).name
    for cut in [i for i, c in enumerate(name) if c == "_"][::-1]:
        parent_prefix = str(Path(prefix).with_name(name[:cut]))
        parent = _load_manifest(parent_prefix) if manifest_path(parent_prefix).is_file() else None
        if parent and name[cut + 1:] in parent.get("outputs", {}):
            return [Target(prefix, name[cut + 1:], parent, manifest_path(parent_prefix))]
    if not idx_path(prefix).exists():
        raise PrepError(f"{prefix}: neither {idx_path(prefix)} nor {manifest_path(prefix)} exists; "
                        "pass the --output-prefix the data was prepared with")
    return [Target(prefix, None, None, None)]


def _output_entry(t: Target) -> dict | None:
    if t.manifest is None:
        return None
    outputs = t.manifest.get("outputs") or {}
    if t.key is not None and t.key in outputs:
        return outputs[t.key]
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    return None


def check_structure(ds: IndexedDataset) -> list[str]:
    """Problems in one pair that the files alone reveal (the reader already checked sizes it needs)."""
    problems = []
    n, itemsize = ds.sequence_count, ds.dtype.itemsize
    expected_idx = HEADER_SIZE + 12 * n + 8 * ds.document_count
    actual_idx = ds.idx_path.stat().st_size
    if actual_idx != expected_idx:
        problems.append(f"{ds.idx_path}: {actual_idx} bytes, expected exactly {expected_idx} from its counts")
    if n:
        if (ds.lengths < 0).any():
            problems.append(f"{ds.idx_path}: negative sequence length at sequence {int(np.argmax(ds.lengths < 0))}")
        if ds.pointers[0] != 0:
            problems.append(f"{ds.idx_path}: first pointer is {int(ds.pointers[0])}, expected 0")
        step = np.diff(ds.pointers)
        bad = np.nonzero(step != ds.lengths[:-1].astype(np.int64) * itemsize)[0]
        if bad.size:
            problems.append(f"{ds.idx_path}: pointers not contiguous/monotonic at sequence {int(bad[0]) + 1} "
                            f"({bad.size} places)")
    docs = ds.document_indices
    if ds.document_count == 0 or docs[0] != 0:
        problems.append(f"{ds.idx_path}: document indices must start at 0")
    elif (np.diff(docs) < 0).any() or docs[-1] != n:
        problems.append(f"{ds.idx_path}: document indices not increasing up to the sequence count {n}")
    if ds.bin_size != ds.data_end:
        problems.append(f"{ds.bin_path}: {ds.bin_size} bytes but the index accounts for {ds.data_end}")
    return problems


def _check_manifest(t: Target, ds: IndexedDataset, checksums: bool) -> list[str]:
    if t.manifest is None:
        return [f"{manifest_path(t.data_prefix)}: missing -- the run that wrote {t.data_prefix} did not finish "
                "(or another tool wrote it); re-run the prep"]
    problems = []
    where = t.manifest_file
    entry = _output_entry(t)
    if entry is None:
        return [f"{where}: has no entry for {t.data_prefix}"]
    if t.manifest.get("dtype") not in (None, ds.dtype.name) and not _is_mask(t):  # masks: _check_loss_mask
        problems.append(f"{where}: dtype {t.manifest.get('dtype')} but {ds.idx_path} holds {ds.dtype.name}")
    for field, actual in (("documents", ds.num_documents), ("tokens", ds.num_tokens),
                          ("bin_size", ds.bin_size), ("idx_size", ds.idx_path.stat().st_size)):
        if field in entry and entry[field] != actual:
            problems.append(f"{where}: {field} {entry[field]:,} but the files have {actual:,}")
    if checksums:
        for field, path in (("bin_sha256", ds.bin_path), ("idx_sha256", ds.idx_path)):
            if field in entry and entry[field] != file_sha256(path):
                problems.append(f"{path}: SHA-256 differs from {where} (file changed or corrupt)")
    counts = t.manifest.get("documents")
    if isinstance(counts, dict) and {"read", "written", "empty", "rejected"} <= set(counts):
        if counts["read"] != counts["written"] + counts["empty"] + counts["rejected"]:
            problems.append(f"{where}: counts do not reconcile: read {counts['read']} != written "
                            f"{counts['written']} + empty {counts['empty']} + rejected {counts['rejected']}")
        if counts["written"] != ds.num_documents:
            problems.append(f"{where}: {counts['written']:,} documents written but {ds.idx_path} has "
                            f"{ds.num_documents:,}")
    return problems


def _mask_prefix(t: Target, key: str) -> str | None:
    """The data prefix of the loss mask that goes with output ``key`` (`mmtrain-prep sft`), or None."""
    masks = (t.manifest or {}).get("loss_masks") or {}
    entry = ((t.manifest or {}).get("outputs") or {}).get(masks.get(key))
    if not isinstance(entry, dict) or "idx" not in entry:
        return None
    return str(Path(t.data_prefix).parent / Path(entry["idx"]).with_suffix(""))


def _is_mask(t: Target) -> bool:
    return t.key is not None and t.key in ((t.manifest or {}).get("loss_masks") or {}).values()


def _check_loss_mask(t: Target, ds: IndexedDataset) -> list[str]:
    """A loss mask holds only 0/1; the tokens it belongs to have exactly its document lengths."""
    if _is_mask(t):
        if ds.dtype != np.uint8:
            return [f"{ds.idx_path}: a loss mask must be uint8, it holds {ds.dtype.name}"]
        for start in range(0, len(ds), 1 << 16):
            values = ds.tokens_of_range(start, min(len(ds), start + (1 << 16)))
            if values.size and values.max() > 1:
                return [f"{ds.bin_path}: loss mask holds values other than 0 and 1 (damaged; re-run the prep)"]
        return []
    mask_prefix = _mask_prefix(t, t.key) if t.key is not None else None
    if mask_prefix is None:
        return []
    try:
        mask = IndexedDataset(mask_prefix)
    except IndexedFormatError:
        return []  # reported as that target's own problem
    if len(mask) != len(ds) or not np.array_equal(mask.lengths, ds.lengths):
        return [f"{ds.idx_path}: document lengths differ from its loss mask {mask.idx_path}; re-run the prep"]
    return []


def verify_text(args: argparse.Namespace) -> int:
    report = []
    for t in resolve_targets(str(args.target)):
        try:
            ds = IndexedDataset(t.data_prefix)
        except IndexedFormatError as exc:
            report.append({"prefix": t.data_prefix, "ok": False, "problems": [str(exc)]})
            continue
        problems = check_structure(ds) + _check_manifest(t, ds, not args.no_checksums) + _check_loss_mask(t, ds)
        report.append({"prefix": t.data_prefix, "ok": not problems, "problems": problems,
                       "documents": ds.num_documents, "tokens": ds.num_tokens, "dtype": ds.dtype.name})
    ok = all(r["ok"] for r in report)
    if args.json:
        print(json.dumps({"ok": ok, "datasets": report}, indent=2))
    else:
        for r in report:
            if r["ok"]:
                print(f"OK {r['prefix']}: {r['documents']:,} documents, {r['tokens']:,} tokens, {r['dtype']}"
                      + ("" if args.no_checksums else ", checksums match"))
            else:
                for problem in r["problems"]:
                    print(f"PROBLEM {problem}")
    return 0 if ok else 1


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) over power-of-two buckets [0,1), [1,2), [2,4), ... up to the longest."""
    if lengths.size == 0:
        return []
    edges = [0, 1]
    while edges[-1] <= int(lengths.max()):
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(lengths, bins=edges)
    return [(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts) if c]


def _tokenizer_for(args, t: Target):
    source = args.tokenizer or ((t.manifest or {}).get("tokenizer") or {}).get("path")
    if not source:
        raise PrepError(f"--doc needs a tokenizer: {t.data_prefix} has no manifest naming one; pass --tokenizer")
    recorded = {} if args.tokenizer else (t.manifest or {}).get("tokenizer") or {}
    return load_tokenizer(source, recorded.get("type"), merge_file=recorded.get("merges_path"))


def _loss_runs(tokenizer, ids: list[int], mask: list[int]) -> list[tuple[bool, int, str]]:
    """(carries loss, token count, decoded text) for each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs.append((bool(mask[start]), i - start, tokenizer.decode(ids[start:i])))
            start = i
    return runs


def inspect_text(args: argparse.Namespace) -> int:
    summaries = []
    for t in resolve_targets(str(args.target)):
        try:
            ds = IndexedDataset(t.data_prefix)
        except IndexedFormatError as exc:
            raise PrepError(str(exc)) from None
        lengths = ds.lengths
        info = {"prefix": t.data_prefix, "key": t.key, "documents": ds.num_documents, "sequences": len(ds),
                "tokens": ds.num_tokens, "dtype": ds.dtype.name, "bin_bytes": ds.bin_size,
                "length": {"min": int(lengths.min()) if lengths.size else 0,
                           "mean": float(lengths.mean()) if lengths.size else 0.0,
                           "median": float(np.median(lengths)) if lengths.size else 0.0,
                           "max": int(lengths.max()) if lengths.size else 0},
                "histogram": length_histogram(lengths)}
        if t.manifest is not None:
            info["manifest"] = {k: t.manifest.get(k) for k in ("command", "created", "documents", "tokenizer",
                                                                "append_eod", "elapsed_s") if k in t.manifest}
        docs = []
        mask_prefix = _mask_prefix(t, t.key) if t.key is not None else None
        if args.doc and not _is_mask(t):
            tokenizer = _tokenizer_for(args, t)
            mask = IndexedDataset(mask_prefix) if mask_prefix else None
            for k in args.doc:
                if not -ds.num_documents <= k < ds.num_documents:
                    raise PrepError(f"--doc {k}: {t.data_prefix} has documents 0..{ds.num_documents - 1}")
                ids = ds[k].tolist()
                doc = {"doc": k, "tokens": len(ids), "ids": ids[:64], "text": tokenizer.decode(ids)}
                if mask is not None:
                    doc["loss_runs"] = _loss_runs(tokenizer, ids, mask[k].tolist())
                docs.append(doc)
        info["decoded"] = docs
        summaries.append(info)
    if args.json:
        print(json.dumps(summaries, indent=2, ensure_ascii=False))
        return 0
    for s in summaries:
        print(f"{s['prefix']}" + (f" (key {s['key']!r})" if s["key"] else ""))
        print(f"  documents {s['documents']:,}  tokens {s['tokens']:,}  dtype {s['dtype']}  "
              f".bin {s['bin_bytes'] / 1e6:,.2f} MB")
        ln = s["length"]
        print(f"  tokens per document: min {ln['min']:,}  mean {ln['mean']:,.1f}  median {ln['median']:,.0f}  "
              f"max {ln['max']:,}")
        peak = max((c for _, _, c in s["histogram"]), default=1)
        for low, high, count in s["histogram"]:
            print(f"  {low:>9,} - {high - 1:>9,} | {'#' * max(1, round(40 * count / peak)):<40} {count:,}")
        if "manifest" in s:
            m = s["manifest"]
            tok = m.get("tokenizer") or {}
            print(f"  made by {m.get('command')} at {m.get('created')}; documents {m.get('documents')}")
            if tok:
                print(f"  tokenizer {tok.get('path')} ({tok.get('type')}, vocab {tok.get('vocab_size')}, "
                      f"eod {tok.get('eod_id')})")
        else:
            print("  no manifest (incomplete run, or written by another tool)")
        for d in s["decoded"]:
            print(f"  --- document {d['doc']} ({d['tokens']} tokens)")
            if "loss_runs" in d:  # one line per run of tokens with / without loss
                print(f"  {sum(n for loss, n, _ in d['loss_runs'] if loss):,} tokens carry the loss (LOSS lines)")
                for loss, n, text in d["loss_runs"]:
                    print(f"  {'LOSS' if loss else '----'} {text[:2000]!r}")
                continue
            print(f"  {d['text']!r}" if len(d["text"]) < 2000 else f"  {d['text'][:2000]!r} ...")
    sys.stdout.flush()
    return 0
