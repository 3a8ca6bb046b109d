"""The multimodal half of README command 1: images, audio and text -> prep -> a tiny VLM -> a caption, on the CPU.

    python -m mmtrain.demo_vlm [--out runs/demo/vlm] [--steps 50]

Steps (each the public command a user runs, as a subprocess): generate coloured-shape images with captions that
say what they show, a few audio clips and a short video (``dataprep.samples_media``) and a text corpus -> train a
tokenizer on corpus and captions -> `mmtrain-prep text` -> `mmtrain-prep media` -> a blend spec mixing the text
shards and the media shards -> `mmtrain.pretrain_vlm` (configs/vlm/tiny_cpu.yaml) -> greedy caption of an image.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "vlm" / "tiny_cpu.yaml"


def _step(title: str, cmd: list[str]) -> None:
    import subprocess

    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"--- done in {time.monotonic() - start:.1f}s", flush=True)


def _write_blend(path: Path, text_prefix: Path, media_dir: Path, text_weight: float, media_weight: float) -> Path:
    """A blend spec (docs/blend-spec.md) mixing the indexed text and the energon media shards."""
    from mmtrain.utils.atomic import atomic_write_text

    body = (f"# text rows carry no image; media rows images (and audio, video frames)\ntrain:\n"
            f"  - {{path: {text_prefix}, weight: {text_weight}}}\n"
            f"  - {{path: {media_dir}, type: energon, weight: {media_weight}}}\n")
    return atomic_write_text(path, body)


def _caption_image(run_dir: Path, image_path: Path, max_new_tokens: int = 16) -> str:
    """Greedy caption of one image by the run's last checkpoint (one process, CPU)."""
    import torch
    from PIL import Image

    from mmtrain.config import load_config
    from mmtrain.config.vlm_run_schema import VLMRunConfig
    from mmtrain.data.multimodal import MultimodalTaskEncoder
    from mmtrain.data.multimodal_loader import settings_from_config
    from mmtrain.models.vlm import VLMModel
    from mmtrain.train.checkpoint_state import load_model_weights_only

    cfg = load_config(VLMRunConfig, run_dir / "config.yaml")
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    model = VLMModel(cfg.model)
    load_model_weights_only(ckpt, None, model)
    encoder = MultimodalTaskEncoder(settings_from_config(cfg.media, cfg.model, cfg.data.seq_length))
    pixels = torch.from_numpy(__import__("numpy").asarray(Image.open(image_path).convert("RGB")).copy())
    image = encoder._image(pixels.permute(2, 0, 1).float() / 255.0)  # the training path's resize + normalize
    prompt = [cfg.model.image_token_id] * cfg.model.tokens_per_image
    tok = encoder.tokenizer
    new = model.generate(prompt, image[None], max_new_tokens=max_new_tokens, eos_id=tok.eod_id)
    return tok.decode([t for t in new if t != tok.eod_id])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmtrain.demo_vlm", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo/vlm", help="folder for everything this demo writes")
    ap.add_argument("--steps", type=int, default=50, help="training steps")
    ap.add_argument("--images", type=int, default=160, help="images in the sample media set")
    ap.add_argument("--docs", type=int, default=400, help="documents in the text corpus")
    args = ap.parse_args(argv)
    out = Path(args.out)
    py = sys.executable

    from dataprep.samples import write_sample_jsonl
    from dataprep.samples_media import write_media_samples

    corpus = write_sample_jsonl(out / "data" / "corpus.jsonl", num_docs=args.docs)
    manifest = write_media_samples(out / "media_src", num_images=args.images, num_audio=6, video=True)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    captions = out / "data" / "captions.jsonl"
    captions.write_text("".join(json.dumps({"text": r.get("caption") or r.get("text") or
                                            r["conversation"][-1]["content"]}) + "\n" for r in rows))
    print(f"=== sample data: {len(rows)} media samples in {manifest}, {args.docs} text documents in {corpus}",
          flush=True)
    tok = out / "tokenizer" / "sp"
    _step("train a tokenizer on the corpus and the captions",
          [py, "-m", "dataprep", "train-tokenizer", "--input", str(corpus), str(captions), "--output-prefix",
           str(tok), "--vocab-size", "512"])
    prefix = out / "shards" / "corpus"
    _step("tokenize the text into indexed shards",
          [py, "-m", "dataprep", "text", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer",
           f"{tok}.model", "--append-eod", "--workers", "1"])
    media = out / "shards" / "media"
    _step("pack images, audio and video into WebDataset shards",
          [py, "-m", "dataprep", "media", "--input", str(manifest), "--output", str(media), "--workers", "2",
           "--val-ratio", "0.05", "--overwrite", "--no-progress"])
    blend = _write_blend(out / "blend.yaml", prefix.resolve(), media.resolve(), text_weight=1, media_weight=3)
    print(f"\n=== blend spec {blend}:\n{blend.read_text()}", flush=True)
    run_dir = out / "train"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (a kept run dir would resume)
    _step("train a tiny VLM on the CPU (a quarter of the rows are text only)",
          [py, "-m", "mmtrain.pretrain_vlm", "--config", str(CONFIG), f"train.steps={args.steps}",
           f"logging.run_dir={run_dir}", f"data.blend={blend}", f"media.tokenizer={tok}.model"])
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    k = max(1, len(losses) // 10)
    print(f"\n=== loss: first {k} steps {sum(losses[:k]) / k:.3f} -> last {k} steps {sum(losses[-k:]) / k:.3f}")
    image_row = next(r for r in rows if "caption" in r and "image" in r)
    caption = _caption_image(run_dir, manifest.parent / image_row["image"])
    print(f"=== caption of {image_row['image']}\n    true:      {image_row['caption']}\n    generated: {caption}")
    print(f"\nVLM demo done. Outputs under {out}/", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
