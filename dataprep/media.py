"""`mmtrain-prep media`: images, video and audio with their text -> WebDataset tar shards that megatron-energon
loads as they are (``.nv-meta/`` written here; no ``energon prepare`` step).

The main process reads the manifest in order, hands batches of rows to worker processes (validation and
re-encoding, `media_codecs`), takes the results back in order and appends them to the shard sequence of
each sample's split (`media_shards`). Every row read is either written or listed in ``rejects.jsonl``.
A run state file records each completed shard, so ``--resume`` continues without redoing or duplicating.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator

from dataprep.errors import PrepError
from dataprep.jsonl import jsonl_line
from dataprep.media_chat import ChatMediaOptions, ChatRowEncoder, ChatRowError
from dataprep.media_codecs import MediaOptions, MediaReject, Packed, pack_batch
from dataprep.media_manifest import Reject, input_fingerprint, is_val, iter_rows
from dataprep.media_shards import NV_META, SPLITS, ShardRecord, ShardSetWriter, scan_shard, write_energon_meta
from dataprep.progress import add_progress_argument, progress_enabled
from mmtrain.utils.atomic import atomic_write_text, fsync_dir

STATE_FILE = ".mmtrain-prep-state.json"
OVERWRITE_BUILD = ".overwrite-build"  # where --overwrite builds the new output, swapped in once complete
MANIFEST_FORMAT = "mmtrain-media-shards/1"
_BATCH_ROWS = 8  # rows per worker task: amortizes process hand-off for small images


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise PrepError(f"--shard-size {text!r}: expected a size like 512MB, 1GiB or 100000")
    unit = m.group(2).lower().rstrip("b")
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="MANIFEST_OR_DIR",
                   help="JSONL manifest(s) (paths relative to each manifest's folder) or a folder of media "
                        "files with same-stem .txt captions")
    p.add_argument("--output", required=True, metavar="DIR", help="output folder (shards, .nv-meta/, manifest.json)")
    p.add_argument("--shard-size", default="512MB", help="target shard size, e.g. 512MB, 1GiB (default 512MB)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="worker processes for decoding/re-encoding (default: CPU count); the output is the "
                        "same for any value")
    p.add_argument("--val-ratio", type=float, default=0.01,
                   help="share of samples in the val split, by a hash of the sample id (default 0.01)")
    p.add_argument("--sample-type", choices=["auto", "captioning", "crude"], default="auto",
                   help="dataset.yaml sample type: auto = CaptioningSample when every row is one image with "
                        "caption/text, else CrudeWebdataset (crude.yaml is always written too)")
    g = p.add_argument_group("media")
    g.add_argument("--image-format", choices=["jpeg", "webp", "png"], default=None,
                   help="re-encode every image to this format (EXIF orientation applied); default keeps the "
                        "original bytes")
    g.add_argument("--max-side", type=int, default=None, metavar="N",
                   help="downscale images whose longer side exceeds N pixels (re-encodes those)")
    g.add_argument("--jpeg-quality", type=int, default=90, help="JPEG/WEBP quality when re-encoding (default 90)")
    g.add_argument("--audio-rate", type=int, default=None, metavar="HZ",
                   help="resample audio to HZ (stored as 16-bit WAV)")
    g.add_argument("--mono", action="store_true", help="downmix audio to mono (stored as 16-bit WAV)")
    g.add_argument("--video-frames", type=int, default=0, metavar="K",
                   help="also store K evenly spaced frames of each video as JPEG (frame000.jpg ...)")
    g.add_argument("--max-file-mb", type=float, default=512.0, help="reject media files larger than this (default 512)")
    g.add_argument("--max-image-pixels", type=int, default=100_000_000, help="reject larger images (default 1e8)")
    g.add_argument("--full-decode", action="store_true",
                   help="validate kept images by decoding every pixel at full size (default: JPEG decoded at "
                        "1/8 scale, which still reads every coded bit; PNG checked by the CRC of every chunk)")
    g.add_argument("--fix-extensions", action="store_true",
                   help="store images whose extension disagrees with their content under the right extension "
                        "(default: reject them)")
    g.add_argument("--allow-outside", action="store_true",
                   help="permit absolute paths and paths that leave the manifest's folder")
    c = p.add_argument_group("chat rows (images in user turns: OpenAI 'messages' with image parts, or ShareGPT "
                             "'conversations' with <image> and 'image')")
    c.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer.json or its folder: chat rows are rendered and tokenized at prep "
                        "time, with the loss mask on the assistant tokens (needed when the input has chat rows)")
    c.add_argument("--chat-template", default="tokenizer", metavar="NAME",
                   help="'tokenizer' (its own Jinja template, default), a built-in (chatml, llama3) or a .jinja file")
    c.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="reject chat rows longer than N tokens, counting each image as one (the loader expands it "
                        "to model.tokens_per_image)")
    r = p.add_argument_group("run")
    r.add_argument("--resume", action="store_true", help="continue an interrupted run into the same DIR")
    r.add_argument("--overwrite", action="store_true", help="build anew and replace a previous output of this command in DIR once the new one is "
                        "complete (until then the previous one stays whole)")
    add_progress_argument(r)
    # Test hook: behave as if interrupted after K shards were completed (exercises --resume).
    r.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)


def _options(args: argparse.Namespace) -> MediaOptions:
    for name in ("max_side", "audio_rate"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise PrepError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.video_frames < 0:
        raise PrepError("--video-frames must be >= 0")
    if not 1 <= args.jpeg_quality <= 100:
        raise PrepError("--jpeg-quality must be in 1..100")
    return MediaOptions(image_format=args.image_format, max_side=args.max_side, jpeg_quality=args.jpeg_quality,
                        audio_rate=args.audio_rate, mono=args.mono, video_frames=args.video_frames,
                        max_file_bytes=int(args.max_file_mb * 1e6), max_image_pixels=args.max_image_pixels,
                        fix_extensions=args.fix_extensions, full_decode=args.full_decode)


def _our_files(out: Path) -> list[Path]:
    names = [p for p in out.iterdir() if re.fullmatch(r"\.?shard-(train|val)-\d{6}\.tar(\.idx|\.tmp)?", p.name)]
    return names + [p for p in (out / NV_META, out / "manifest.json", out / "rejects.jsonl", out / STATE_FILE)
                    if p.exists()]


def _prepare_output(out: Path, fingerprint: str, args) -> list[ShardRecord]:
    """Check/clean DIR; return the shards a previous interrupted run completed (for --resume)."""
    if out.exists() and not out.is_dir():
        raise PrepError(f"--output {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    ours = _our_files(out)
    if args.overwrite:  # the new output is built beside (OVERWRITE_BUILD) and swapped in once complete
        return []
    if not args.resume:
        if ours:
            raise PrepError(f"{out} already holds shards from a previous run; pass --resume to continue it "
                            "or --overwrite to start again")
        return []
    if not state_path.exists():
        if (out / "manifest.json").exists():
            raise PrepError(f"{out} is complete (manifest.json present, no run state); nothing to resume. "
                            "Use --overwrite to build it again")
        if ours:
            raise PrepError(f"{out} has shard files but no run state ({STATE_FILE}); use --overwrite")
        return []
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        same_inputs = state.get("fingerprint") == fingerprint
        done = [ShardRecord(**r) for r in state["shards"]] if same_inputs else []
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise PrepError(f"{state_path}: unreadable run state (damaged?); pass --overwrite to start again") from None
    if not same_inputs:
        raise PrepError(f"{out}: the interrupted run used other inputs or options; rerun with the same "
                        "ones, or pass --overwrite to start again")
    for rec in done:
        path = out / rec.name
        if not path.exists() or path.stat().st_size != rec.bytes:
            raise PrepError(f"{path}: missing or changed since the interrupted run; use --overwrite")
    for p in out.glob(".shard-*.tmp"):
        p.unlink()  # a shard that was being written when the run stopped: it is rebuilt from its rows
    return done


def _overwrite_stage(out: Path) -> Path:
    """The folder an --overwrite run builds in: inside DIR (same file system, so the swap is renames), hidden,
    emptied first (what an interrupted --overwrite run left there is of no use)."""
    stage = out / OVERWRITE_BUILD
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    return stage


def _swap_in(stage: Path, out: Path) -> None:
    """Replace the earlier output in ``out`` by the complete new one in ``stage``: only renames, so the earlier
    output stays whole and readable until the new one is complete."""
    old = out / ".overwrite-old"
    if old.exists():
        shutil.rmtree(old)
    old.mkdir()
    for p in sorted(_our_files(out), key=lambda p: p.name != "manifest.json"):  # the manifest first: incomplete
        os.replace(p, old / p.name)
    for p in sorted(stage.iterdir(), key=lambda p: p.name == "manifest.json"):  # the manifest last: complete
        os.replace(p, out / p.name)
    stage.rmdir()
    fsync_dir(out)
    shutil.rmtree(old)


def _init_worker() -> None:
    """Workers leave Ctrl-C to the main process, which stops them and cleans up (no traceback per worker),
    and on Linux die with it: a killed main process must not leave orphans decoding for nobody."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _ordered_results(batches: Iterator[list], workers: int) -> Iterator[tuple[list, list]]:
    """(batch, results) in submission order; at most a few batches per worker in flight (bounded memory)."""
    if workers <= 1:
        for batch in batches:
            yield batch, pack_batch(batch)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    window = collections.deque()
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker) as pool:
        try:
            for batch in batches:
                window.append((batch, pool.submit(pack_batch, batch, True)))
                if len(window) >= 4 * workers:
                    b, fut = window.popleft()
                    yield b, fut.result()
            while window:
                b, fut = window.popleft()
                yield b, fut.result()
        except BrokenProcessPool:
            raise PrepError("a worker process died (out of memory?); the completed shards are kept: rerun "
                            "with --resume and fewer --workers") from None
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _count_records(inputs: list[str]) -> int | None:
    """Non-blank manifest lines, for the progress bar's total (None when an input is a folder)."""
    total = 0
    for inp in inputs:
        if Path(inp).is_dir():
            return None
        with open(inp, "rb") as f:
            total += sum(1 for line in f if line.strip())
    return total


class _Progress:
    """tqdm bar: rows done (its rate is samples/s) and media MB/s in the postfix."""

    def __init__(self, enabled: bool, inputs: list[str]):
        self.bar = None
        self.t0 = time.monotonic()
        self.bytes = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=_count_records(inputs), unit=" samples", desc="media", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, rows_done: int, nbytes: int) -> None:
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(rows_done - self.bar.n)
            dt = max(time.monotonic() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.bytes / 1e6 / dt:.1f} MB/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    opts = _options(args)
    shard_size = parse_size(args.shard_size)
    if shard_size < 10240:
        raise PrepError("--shard-size must be at least 10KB")
    if not 0.0 <= args.val_ratio < 1.0:
        raise PrepError(f"--val-ratio must be in [0, 1), got {args.val_ratio}")
    if args.workers < 1:
        raise PrepError("--workers must be at least 1")
    for inp in args.input:
        if not Path(inp).exists():
            raise PrepError(f"--input {inp}: no such file or folder")
        if not os.access(inp, os.R_OK | (os.X_OK if Path(inp).is_dir() else 0)):
            raise PrepError(f"--input {inp}: not readable (permission denied)")
    out = Path(args.output)
    for inp in args.input:
        if Path(inp).is_dir() and out.resolve().is_relative_to(Path(inp).resolve()):
            raise PrepError(f"--output {out} is inside the input folder {inp}; its shards would become input. "
                            "Write the output somewhere else")
    if args.max_length is not None and args.max_length < 1:
        raise PrepError("--max-length must be 1 or more")
    if args.tokenizer is None and (args.chat_template != "tokenizer" or args.max_length is not None):
        raise PrepError("--chat-template and --max-length apply to chat rows, which are tokenized at prep time: "
                        "pass --tokenizer too")
    chat = None
    if args.tokenizer is not None:
        chat = ChatRowEncoder(ChatMediaOptions(args.tokenizer, args.chat_template, args.max_length))
    settings = {"options": opts.to_json(), "shard_size": shard_size, "val_ratio": args.val_ratio,
                "sample_type": args.sample_type, "allow_outside": args.allow_outside}
    if chat is not None:
        settings["chat"] = chat.describe()
    fingerprint = hashlib.sha256(json.dumps([input_fingerprint(args.input), settings], sort_keys=True)
                                 .encode()).hexdigest()
    try:
        done = _prepare_output(out, fingerprint, args)
    except OSError as exc:
        raise PrepError(_unwritable(out, exc)) from None
    final_out = None
    if args.overwrite:
        try:
            final_out, out = out, _overwrite_stage(out)
        except OSError as exc:
            raise PrepError(_unwritable(out, exc)) from None
    done_keys = {s.key for rec in done for s in scan_shard(out / rec.name)[0]}
    start_index = {split: sum(1 for r in done if r.split == split) for split in SPLITS}

    shards: list[ShardRecord] = list(done)
    completed_this_run = [0]

    def on_shard(rec: ShardRecord) -> None:
        shards.append(rec)
        atomic_write_text(out / STATE_FILE, json.dumps({"fingerprint": fingerprint,
                                                        "shards": [s.to_json() for s in shards]}, indent=1))
        completed_this_run[0] += 1
        if args.stop_after_shards is not None and completed_this_run[0] >= args.stop_after_shards:
            raise KeyboardInterrupt  # the test hook: stop exactly as an interrupted run would

    writer = ShardSetWriter(out, shard_size, start_index, on_shard)
    rejects: list[Reject] = []
    counts = collections.Counter()
    kinds: set[tuple[str, str]] = set()  # (modality, text field) of written rows, for the sample type
    source_order = {str(Path(p)): i for i, p in enumerate(args.input)}
    progress = _Progress(progress_enabled(args.progress), args.input)
    t0 = time.monotonic()

    def batches() -> Iterator[list]:
        batch = []
        for item in iter_rows(args.input, args.allow_outside):
            counts["rows_read"] += 1
            if isinstance(item, Reject):
                rejects.append(item)
                continue
            if item.text_field == "chat":
                item = _encode_chat(chat, item)
                if isinstance(item, Reject):
                    rejects.append(item)
                    continue
            if args.sample_type == "captioning" and (item.modality != "image"
                                                     or item.text_field not in ("caption", "text")):
                rejects.append(Reject(item.source, item.line, "bad_field",
                                      f"--sample-type captioning takes one image with a caption or text per row; "
                                      f"this row is {item.modality} with {item.text_field} (use --sample-type crude)",
                                      item.record))
                continue
            if item.key in done_keys:  # already in a shard completed before the interruption
                counts["written"] += 1
                counts["val" if is_val(item.key, args.val_ratio) else "train"] += 1
                counts[f"modality:{item.modality}"] += 1
                kinds.add((item.modality, item.text_field))
                continue
            batch.append((item, opts))
            if len(batch) >= _BATCH_ROWS:
                yield batch
                batch = []
        if batch:
            yield batch

    try:
        for batch, results in _ordered_results(batches(), args.workers):
            nbytes = 0
            for (row, _), res in zip(batch, results):
                if isinstance(res, Packed):
                    try:
                        parts = res.resolve()
                    except MediaReject as exc:
                        res = (exc.code, exc.reason)
                    except OSError as exc:  # a kept file vanished or became unreadable since its check
                        res = ("unreadable_media", f"{res.key}: cannot read it again to pack it: {exc.strerror}")
                if isinstance(res, Packed):
                    split = "val" if is_val(row.key, args.val_ratio) else "train"
                    writer.add(split, res.key, parts, row.modality)
                    counts["written"] += 1
                    counts[split] += 1
                    counts[f"modality:{row.modality}"] += 1
                    counts["media_bytes"] += res.nbytes
                    kinds.add((row.modality, row.text_field))
                    nbytes += res.nbytes
                else:
                    rejects.append(Reject(row.source, row.line, res[0], res[1], row.record))
            progress.update(counts["rows_read"], nbytes)  # rows read runs a few batches ahead of rows packed
        writer.finish()
        progress.update(counts["rows_read"], 0)
    except BaseException as exc:
        writer.abandon()
        progress.close()
        if isinstance(exc, OSError):
            raise PrepError(_unwritable(out, exc)) from None
        raise
    progress.close()
    elapsed = time.monotonic() - t0

    try:
        return _finish(args, out, shards, writer.index, done_keys, rejects, counts, kinds, source_order,
                       settings, elapsed, final_out)
    except OSError as exc:
        raise PrepError(_unwritable(out, exc)) from None


def _encode_chat(chat: ChatRowEncoder | None, row):
    """A chat row with its tokens and loss mask, or its Reject."""
    if chat is None:
        return Reject(row.source, row.line, "needs_tokenizer", "a chat row (images in user turns) is tokenized "
                      "with its chat template at prep time: pass --tokenizer (and --chat-template)", row.record)
    try:
        return dataclasses.replace(row, chat=chat.encode(row))
    except ChatRowError as exc:
        return Reject(row.source, row.line, exc.code, exc.reason, row.record)


def _unwritable(out: Path, exc: OSError) -> str:
    where = exc.filename or out
    return (f"cannot write the output in {out}: {where}: {exc.strerror or exc}; choose a folder you can "
            "write to (and with free space)")


def _finish(args, out: Path, shards: list[ShardRecord], index: dict, done_keys: set, rejects: list[Reject],
            counts: collections.Counter, kinds: set, source_order: dict, settings: dict, elapsed: float,
            final_out: Path | None = None) -> int:
    """energon metadata, rejects.jsonl and manifest.json (last) once every shard is complete; the summary.
    ``final_out``: where an --overwrite run's complete output (built in ``out``) is swapped in."""
    if not shards:
        _write_rejects(out, rejects, source_order)
        codes = collections.Counter(r.code for r in rejects)
        raise PrepError(f"no sample could be written: all {counts['rows_read']} rows were rejected "
                        f"({', '.join(f'{k}: {v}' for k, v in sorted(codes.items()))}); "
                        f"see {out / 'rejects.jsonl'}")
    sample_type = args.sample_type
    if sample_type == "auto":
        sample_type = "captioning" if all(m == "image" and t in ("caption", "text") for m, t in kinds) else "crude"
    modalities = sorted({m for m, _ in kinds})
    subflavor = modalities[0] if len(modalities) == 1 else "mixed"
    write_energon_meta(out, shards, sample_type, subflavor, index)
    _write_rejects(out, rejects, source_order)
    reject_codes = collections.Counter(r.code for r in rejects)
    ordered = sorted(shards, key=lambda s: (SPLITS.index(s.split), s.name))
    summary = {
        "rows_read": counts["rows_read"], "written": counts["written"], "rejected": len(rejects),
        "splits": {s: counts[s] for s in SPLITS},
        "modalities": {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("modality:")},
        "rejects_by_code": dict(sorted(reject_codes.items())),
    }
    if summary["rows_read"] != summary["written"] + summary["rejected"]:
        raise RuntimeError(f"row accounting is off: {summary}")  # a bug, not bad input
    manifest = {
        "format": MANIFEST_FORMAT, "created_by": "mmtrain-prep media",
        "inputs": [{"path": str(Path(p).resolve()), "kind": "folder" if Path(p).is_dir() else "manifest"}
                   for p in args.input],
        "input_fingerprint": input_fingerprint(args.input),
        "options": settings, "sample_type": sample_type, "subflavor": subflavor, "counts": summary,
        "total_bytes": sum(s.bytes for s in shards), "shards": [s.to_json() for s in ordered],
    }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    (out / STATE_FILE).unlink(missing_ok=True)
    if final_out is not None:
        _swap_in(out, final_out)
        out = final_out
    mb = counts["media_bytes"] / 1e6
    processed = max(counts["written"] - len(done_keys), 0)
    print(f"mmtrain-prep media: {summary['rows_read']} rows read = {summary['written']} written "
          f"(train {counts['train']}, val {counts['val']}) + {len(rejects)} rejected"
          + (f" ({', '.join(f'{k} {v}' for k, v in sorted(reject_codes.items()))}; see {out / 'rejects.jsonl'})"
             if rejects else "")
          + f"\n  {len(shards)} shards, {manifest['total_bytes'] / 1e6:.1f} MB in {out}; sample type {sample_type}"
          f"\n  {processed / max(elapsed, 1e-9):.1f} samples/s, {mb / max(elapsed, 1e-9):.1f} MB/s"
          f" over {elapsed:.1f}s with {args.workers} worker(s)")
    if args.val_ratio > 0 and not counts["val"]:
        print(f"  note: the val split is empty ({args.val_ratio:g} of {counts['written']} samples rounds to none); "
              "energon's get_val_dataset will refuse it. Raise --val-ratio if you need one")
    return 0


def _write_rejects(out: Path, rejects: list[Reject], source_order: dict[str, int]) -> None:
    rejects.sort(key=lambda r: (source_order.get(r.source, len(source_order)), r.line))
    atomic_write_text(out / "rejects.jsonl", "".join(jsonl_line(r.to_json()) for r in rejects))
