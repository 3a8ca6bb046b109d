"""Packed vs unpacked VLM training on real prepped media shards: real (non-pad) tokens/s per GPU, one table.

    python bench/vlm_pack_h200.py [--images 800] [--steps 6] [--warmup 3] [--compile] [--work DIR] [key=value ...]
    python bench/vlm_pack_h200.py --tiny        # the CPU check: tiny VLM, a few images, 2 steps

What users run, end to end: a synthetic image-caption set (``dataprep.samples_media``: grainy scenes at
320x240..640x480, captions stretched to 20-120 words) goes through ``mmtrain-prep media`` into WebDataset shards,
a SentencePiece tokenizer is trained on the captions, and the ~2B VLM (``configs/vlm/vlm_2b.yaml``) trains on the
shards through the energon loader twice, in two fresh processes: ``media.pack=false`` (one sample per
``data.seq_length`` row, the rest padding) and ``media.pack=true`` (several samples per row, document-masked
attention), at the same sequence length and micro-batch.

Padding is counted honestly: after training, each process draws the same micro-batches again (the loader's order
is deterministic) and counts the positions whose document id is >= 0 (image placeholders and text of real
samples), the loss-bearing tokens and the samples. "real tokens/s" is that count over the timed steps divided
by their time; the packed/unpacked ratio of it is the figure issue #18 asks for (target >= 1.0).

On the GPU machine megatron-energon and webdataset are not installed: ``bench/h200_vlm_pack.sh`` installs the
wheels ``bench/fetch_prep_wheels.sh`` puts into ``.device/whl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_FILLER = ("the light falls softly from the left", "a thin shadow stretches across the ground",
           "the edges look slightly blurred", "there is fine grain over the whole picture",
           "nothing else stands out in the frame", "the colours are flat and even",
           "the shape sits a little off centre", "the background fills most of the view")


def _long_caption(rng: random.Random, caption: str, words: int) -> str:
    """``caption`` followed by filler sentences until it has about ``words`` words (real captions vary)."""
    parts = [caption]
    while len(" ".join(parts).split()) < words:
        parts.append(rng.choice(_FILLER).capitalize() + ".")
    return " ".join(parts)


def prepare(work: Path, images: int, min_words: int, max_words: int) -> tuple[Path, Path]:
    """Write the image-caption set, prep it into shards and train a tokenizer on its captions (reused if there)."""
    from dataprep.cli import main as prep
    from dataprep.samples_media import write_media_samples

    shards, tokenizer, src = work / f"shards-{images}", work / "sp.model", work / f"in-{images}"
    if not (shards / "manifest.json").is_file():
        sizes = ((32, 32), (48, 40)) if images <= 64 else ((320, 240), (640, 480), (480, 360))
        manifest = write_media_samples(src, num_images=images, num_audio=0, video=False, sizes=sizes, noise=12,
                                       conversations=0)
        rng = random.Random(0)
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        for row in rows:
            row["caption"] = _long_caption(rng, row["caption"], rng.randint(min_words, max_words))
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if prep(["media", "--input", str(manifest), "--output", str(shards), "--progress", "never",
                 "--val-ratio", "0", "--overwrite"]) != 0:
            raise SystemExit(f"mmtrain-prep media failed on {manifest}")
    if not tokenizer.is_file():
        import sentencepiece as spm

        captions = [json.loads(line)["caption"] for line in (src / "manifest.jsonl").read_text().splitlines()]
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(captions), model_prefix=str(work / "sp"), vocab_size=400, model_type="bpe",
            byte_fallback=True, hard_vocab_limit=False, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1)
    return shards, tokenizer


def _count_drawn(cfg, mesh, micro_batches: int) -> list[dict]:
    """The first ``micro_batches`` micro-batches of this rank's loader, counted: non-pad positions, loss tokens,
    samples (distinct document ids per row) and images."""
    from mmtrain.data.vlm_sources import build_vlm_batches

    batches, counts = build_vlm_batches(cfg, mesh, "train"), []
    for _ in range(micro_batches):
        b = batches.next()
        doc = b.document_ids
        counts.append({"real_tokens": int((doc >= 0).sum()), "loss_tokens": int(b.loss_mask.sum()),
                       "samples": int((doc.max(dim=1).values + 1).clamp(min=0).sum()), "images": b.num_images})
    close = getattr(getattr(batches, "media", None), "close", None)
    if close is not None:
        close()
    return counts


def run_one(a) -> None:
    """One training (this process): print one JSON line with its timed figures."""
    import torch

    from mmtrain.config import load_config
    from mmtrain.config.vlm_run_schema import VLMRunConfig
    from mmtrain.config.vlm_validate import validate_vlm_config
    from mmtrain.models.llama.model import flops_per_token
    from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed
    from mmtrain.train.vlm_train import train_vlm, vision_flops_per_image
    from mmtrain.utils.log import setup_logging

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = REPO / ("configs/vlm/tiny_cpu.yaml" if a.tiny else "configs/vlm/vlm_2b.yaml")
    run_dir = Path(a.work) / f"run-pack-{a.pack}"
    overrides = [f"data.blend={a.shards}", f"media.tokenizer={a.tokenizer}", f"media.pack={str(a.pack).lower()}",
                 f"data.num_workers={a.workers}", f"train.steps={a.steps + a.warmup}", "optim.warmup_steps=1",
                 f"logging.run_dir={run_dir}", "logging.log_every=1", "checkpoint.save_final=false",
                 "train.eval_every=0", f"train.compile={str(a.compile).lower()}", *a.overrides]
    if a.micro_batch:
        overrides.append(f"train.micro_batch_size={a.micro_batch}")
    if a.seq:
        overrides.append(f"data.seq_length={a.seq}")
    cfg = load_config(VLMRunConfig, str(config), overrides)
    validate_vlm_config(cfg, world)
    device = pick_device(cfg.train.device)
    rank, world = init_distributed(cfg.parallel.backend, device)
    setup_logging(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    result = train_vlm(cfg, mesh, device)
    per_step = (cfg.train.global_batch_size or cfg.train.micro_batch_size * mesh.dims.dp) // (
        cfg.train.micro_batch_size * mesh.dims.dp)
    counts = _count_drawn(cfg, mesh, per_step * (a.steps + a.warmup))
    timed = counts[per_step * a.warmup:]
    seconds = sum(result.step_times[a.warmup:])
    dt = statistics.median(result.step_times[a.warmup:])
    real = sum(c["real_tokens"] for c in timed)
    images = sum(c["images"] for c in timed)
    lm_tflops = real * flops_per_token(cfg.model.language, cfg.data.seq_length) / seconds / 1e12
    vit_tflops = images * vision_flops_per_image(cfg.model) / seconds / 1e12
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    if rank == 0:
        row = {"pack": a.pack, "layout": mesh.dims.describe(), "compile": a.compile, "seq": cfg.data.seq_length,
               "micro_batch": cfg.train.micro_batch_size, "step_ms": round(1000 * dt, 1),
               "samples_per_s": round(sum(c["samples"] for c in timed) / seconds / world, 1),
               "images_per_s": round(images / seconds / world, 1),
               "real_tokens_per_s": round(real / seconds / world),
               "loss_tokens_per_s": round(sum(c["loss_tokens"] for c in timed) / seconds / world),
               "slot_tokens_per_s": round(len(timed) * cfg.train.micro_batch_size * cfg.data.seq_length / seconds
                                          / world),
               "fill": round(real / (len(timed) * cfg.train.micro_batch_size * cfg.data.seq_length), 3),
               "tflops_on_real": round((lm_tflops + vit_tflops) / world, 1), "peak_mem_gib": round(mem, 1),
               "loss_first": round(result.losses[0], 3), "loss_last": round(result.losses[-1], 3)}
        print("RESULT " + json.dumps(row), flush=True)
    shutdown_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU check: tiny VLM, few images, 2 timed steps")
    ap.add_argument("--images", type=int, default=None, help="images in the prepped set (default 800; tiny 48)")
    ap.add_argument("--min-words", type=int, default=None, help="shortest caption (default 20; tiny 4)")
    ap.add_argument("--max-words", type=int, default=None, help="longest caption (default 120; tiny 24)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 3; tiny 1)")
    ap.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch_size (default: the config's)")
    ap.add_argument("--seq", type=int, default=0, help="data.seq_length (default: the config's)")
    ap.add_argument("--workers", type=int, default=None, help="data.num_workers (default 6; tiny 0)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--timeout", type=int, default=260, help="seconds for each training process")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-vlm-pack"))
    ap.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    a = ap.parse_args()
    a.images = a.images or (48 if a.tiny else 800)
    a.steps = a.steps or (2 if a.tiny else 6)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    a.workers = a.workers if a.workers is not None else (0 if a.tiny else 6)
    a.min_words, a.max_words = a.min_words or (4 if a.tiny else 20), a.max_words or (24 if a.tiny else 120)
    a.seq = a.seq or (192 if a.tiny else 0)
    if a.run_one:
        return run_one(a)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards, tokenizer = prepare(work, a.images, a.min_words, a.max_words)
    rows = {}
    for pack in (False, True):
        cmd = [sys.executable, __file__, "--run-one", "--shards", str(shards), "--tokenizer", str(tokenizer),
               "--work", str(work), "--images", str(a.images), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--workers", str(a.workers), "--micro-batch", str(a.micro_batch), "--seq", str(a.seq),
               *(["--tiny"] if a.tiny else []), *(["--compile"] if a.compile else []),
               *(["--pack"] if pack else []), *a.overrides]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"media.pack={str(pack).lower()}: no result within {a.timeout} s", flush=True)
            continue
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            print(f"media.pack={str(pack).lower()}: failed (exit {proc.returncode})\n{tail}", flush=True)
            continue
        rows[pack] = json.loads(found[-1][len("RESULT "):])
        print(json.dumps(rows[pack]), flush=True)
    if not rows:
        raise SystemExit(1)
    first = next(iter(rows.values()))
    print(f"\n{a.images} prepped images, captions {a.min_words}-{a.max_words} words, {first['micro_batch']} x "
          f"{first['seq']} tokens per GPU, {first['layout']}, compile {first['compile']}, median of {a.steps} "
          f"timed steps after {a.warmup}")
    cols = ("step_ms", "samples_per_s", "images_per_s", "real_tokens_per_s", "loss_tokens_per_s", "fill",
            "slot_tokens_per_s", "tflops_on_real", "peak_mem_gib", "loss_first", "loss_last")
    print("| media.pack | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for pack, row in rows.items():
        print(f"| {str(pack).lower()} | " + " | ".join(str(row[c]) for c in cols) + " |")
    if len(rows) == 2:
        ratio = rows[True]["real_tokens_per_s"] / max(rows[False]["real_tokens_per_s"], 1)
        print(f"\npacked / unpacked real tokens/s: {ratio:.2f}x (target >= 1.0)")


if __name__ == "__main__":
    main()
