"""README command 1: the main job on the built-in sample, on the CPU, in a few minutes.

    python -m mmtrain.demo [--out runs/demo] [--steps N] [--no-vlm]

Steps (each printed as it runs): generate a sample corpus -> train a tokenizer -> `mmtrain-prep text` ->
`mmtrain-prep verify` -> train a tiny GPT on the shards -> plot its metrics (``mmtrain.plot``: loss, validation
loss, learning rate, tokens/s as PNGs in ``OUT/plots/``, when matplotlib is installed); then the multimodal path (``mmtrain.demo_vlm``):
sample images/audio/video -> `mmtrain-prep text` and `media` -> a blend of text and image-caption shards ->
`mmtrain.pretrain_vlm` for 50 steps -> a caption generated for an image. Each step is the same public command a
user runs by hand, executed as a subprocess, so the demo shows exactly what works end to end.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _step(title: str, cmd: list[str]) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"--- done in {time.monotonic() - start:.1f}s", flush=True)


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _plot(py: str, run_dir: Path, plots: Path) -> None:
    if _have("matplotlib"):
        _step("plot the run's metrics", [py, "-m", "mmtrain.plot", str(run_dir), "--out", str(plots)])
    else:
        print(f"=== (no plots of {run_dir}: matplotlib is not installed; pip install 'mmtrain[plot]')", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmtrain.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="folder for everything the demo writes")
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument("--docs", type=int, default=2000, help="documents in the sample corpus")
    ap.add_argument("--no-vlm", action="store_true", help="skip the multimodal (VLM) part")
    ap.add_argument("--vlm-steps", type=int, default=50, help="VLM training steps")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable

    from dataprep.samples import write_sample_jsonl

    corpus = write_sample_jsonl(out / "data" / "corpus.jsonl", num_docs=args.docs)
    print(f"=== sample corpus: {corpus} ({args.docs} documents, {corpus.stat().st_size / 1e6:.2f} MB)", flush=True)

    train_overrides = ["data.mock=true", "data.prefixes=[]"]
    if _have("dataprep.text") and _have("dataprep.tokenizer_train"):
        tok = out / "tokenizer" / "sp"
        _step("train a SentencePiece tokenizer", [py, "-m", "dataprep", "train-tokenizer", "--input", str(corpus),
                                                  "--output-prefix", str(tok), "--vocab-size", "512"])
        prefix = out / "data" / "corpus"
        _step("tokenize into indexed shards", [py, "-m", "dataprep", "text", "--input", str(corpus),
                                               "--output-prefix", str(prefix), "--tokenizer", f"{tok}.model",
                                               "--append-eod", "--workers", "2"])
        _step("verify the shards", [py, "-m", "dataprep", "verify", str(prefix)])
        # the shards configs/gpt/tiny_cpu.yaml reads (packed documents), wherever --out put them
        train_overrides = [f"data.prefixes=[{prefix}]", "train.eval_every=50"]
    else:
        print("=== (mmtrain-prep text is not built yet: training on mock tokens)", flush=True)

    shutil.rmtree(out / "train", ignore_errors=True)  # a fresh run each time (a kept run dir would resume)
    _step("train a tiny GPT on the CPU", [py, "-m", "mmtrain.pretrain_gpt",
                                          "--config", str(REPO / "configs" / "gpt" / "tiny_cpu.yaml"),
                                          f"train.steps={args.steps}", f"logging.run_dir={out / 'train'}",
                                          *train_overrides])
    _plot(py, out / "train", out / "plots")
    if not args.no_vlm:
        _step("the multimodal path: images, audio and text -> a tiny VLM -> a caption",
              [py, "-m", "mmtrain.demo_vlm", "--out", str(out / "vlm"), "--steps", str(args.vlm_steps)])
        _plot(py, out / "vlm" / "train", out / "vlm" / "plots")
    print(f"\nAll done. Outputs under {out}/", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
