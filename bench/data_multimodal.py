"""Benchmark the multimodal (energon) loader: samples/s per configuration, with and without packing.

    python bench/data_multimodal.py [--images 400] [--image-size 224] [--batches 40] [--workers 0 1]
                                    [--slices 16] [--shuffle-buffer 100] [--repeats 3] [--out DIR]

Writes the sample media set (``dataprep.samples_media``: images with grain, so files have photo-like sizes, at
320x240..640x480) with ``mmtrain-prep media`` under ``--out`` (outside the repository; reused when present),
trains a small SentencePiece tokenizer on its captions, then for each worker count and packing on/off draws
``--batches`` micro-batches of ``--micro-batch-size`` after a warm-up and reports source samples per second
(a pack counts each sample in it). With workers, samples/s per worker is total / workers; with 0 workers all
decoding runs in the main process. The loader reads ``--slices`` energon slices (``media.slices``), each with its
own shuffle and packing buffers; the warm-up (default: one batch per slice, plus 5) fills them, so the figures are
the steady state. ``uptime`` load averages are printed with the table: this is a CPU-bound
loader, so a busy machine lowers every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dataprep.cli import main as prep  # noqa: E402
from dataprep.samples_media import write_media_samples  # noqa: E402
from mmtrain.data.multimodal import MultimodalSettings  # noqa: E402
from mmtrain.data.multimodal_loader import LoaderOptions, MultimodalLoader  # noqa: E402


def prepare(out: Path, images: int) -> tuple[Path, Path]:
    shards, tokenizer = out / f"shards-{images}", out / "sp.model"
    if not (shards / "manifest.json").is_file():
        manifest = write_media_samples(out / f"in-{images}", num_images=images, num_audio=0, video=False,
                                       sizes=((320, 240), (640, 480), (480, 360)), noise=12, conversations=0)
        assert prep(["media", "--input", str(manifest), "--output", str(shards), "--no-progress", "--val-ratio", "0",
                     "--overwrite"]) == 0
    if not tokenizer.is_file():
        import sentencepiece as spm

        rows = [json.loads(line) for line in (out / f"in-{images}" / "manifest.jsonl").read_text().splitlines()]
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([r["caption"] for r in rows]), model_prefix=str(out / "sp"), vocab_size=400,
            model_type="bpe", byte_fallback=True, hard_vocab_limit=False, minloglevel=2, unk_id=0, bos_id=1,
            eos_id=2, pad_id=-1, num_threads=1)
    return shards, tokenizer


def measure(shards: Path, tokenizer: Path, args, workers: int, pack: bool) -> tuple[float, float, float]:
    settings = MultimodalSettings(tokenizer=str(tokenizer), seq_length=args.seq_length, image_token_id=400,
                                  num_image_tokens=args.image_tokens, image_size=args.image_size, pack=pack)
    loader = MultimodalLoader(shards, settings, LoaderOptions(
        micro_batch_size=args.micro_batch_size, num_workers=workers, packing_buffer_size=64,
        shuffle_buffer_size=args.shuffle_buffer, num_slices=args.slices))
    start = time.perf_counter()
    for _ in range(args.warmup if args.warmup >= 0 else args.slices + 5):
        next(loader)
    warmup_seconds = time.perf_counter() - start
    samples, start = 0, time.perf_counter()
    for _ in range(args.batches):
        batch = next(loader)
        samples += int(batch.document_ids.max(dim=1).values.add(1).sum())
    seconds = time.perf_counter() - start
    loader.close()
    return samples / seconds, args.batches / seconds, warmup_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=400)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--image-tokens", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=-1, help="batches before timing; -1: slices + 5")
    p.add_argument("--slices", type=int, default=16, help="media.slices")
    p.add_argument("--shuffle-buffer", type=int, default=100, help="media.shuffle_buffer_size (per slice)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the table shows medians")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench-data-multimodal")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    shards, tokenizer = prepare(args.out, args.images)
    configs = [(w, pack) for w in args.workers for pack in (False, True)]
    results: dict = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved, so every configuration sees the same machine load
        for c in configs:
            results[c].append(measure(shards, tokenizer, args, *c))
    rows = []
    for (workers, pack), runs in results.items():
        sps, bps = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        rows.append((workers, "yes" if pack else "no", sps, sps / max(workers, 1), bps,
                     statistics.median(r[2] for r in runs)))
    print(f"\n{args.images} images (320x240..640x480 JPEG/PNG) -> {args.image_size}px, {args.image_tokens} image "
          f"tokens, seq_length {args.seq_length}, micro-batch {args.micro_batch_size}, {args.batches} batches, "
          f"{args.slices} slices, shuffle buffer {args.shuffle_buffer} per slice, median of {args.repeats} "
          "interleaved rounds")
    print("| workers | packing | samples/s | samples/s per worker | batches/s | warm-up s |")
    print("|---|---|---|---|---|---|")
    for w, pk, sps, spw, bps, warm in rows:
        print(f"| {w} | {pk} | {sps:.1f} | {spw:.1f} | {bps:.2f} | {warm:.1f} |")
    print("load average:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
