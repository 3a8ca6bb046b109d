"""FP8 vs BF16 convergence: a ~70M-parameter Llama-style model trained 300 steps on real tokens, same data, same
seed, same schedule, once per precision; prints both loss curves, the final-loss relative difference (the issue's
bar: within 2%), and draws them into a PNG (Pillow only).

    python3 bench/fp8_convergence.py [--out bench/results] [--steps 300] [--recipes delayed tensorwise] [--compile]
        [--tag NAME] [--set key=value ...]   (e.g. --set fp8.backend=native fp8.output_layer=true)

The corpus is real text shipped with every Python: the standard library's own ``.py`` sources (one document per
file, sorted, so every machine builds the same corpus). It goes through the public prep commands: a
SentencePiece BPE tokenizer (``mmtrain-prep train-tokenizer``, vocab 8192) and ``mmtrain-prep text``; training
reads the indexed shards through the normal data pipeline (``data.prefixes``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["model.name=conv-70m", "model.num_layers=8", "model.hidden_size=768", "model.ffn_hidden_size=2048",
         "model.num_attention_heads=12", "model.num_query_groups=4", "model.vocab_size=8192",
         "model.rope_theta=10000"]


def build_corpus(work: Path, max_docs: int) -> Path:
    """JSONL of the stdlib's .py files (text only, deterministic order)."""
    corpus = work / "stdlib.jsonl"
    if corpus.exists():
        return corpus
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)[:max_docs]
    tmp = corpus.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
    tmp.rename(corpus)
    return corpus


def prep(work: Path, max_docs: int) -> Path:
    corpus = build_corpus(work, max_docs)
    tok, prefix = work / "tok", work / "stdlib"
    py = sys.executable
    if not Path(f"{tok}.model").exists():
        subprocess.run([py, "-m", "dataprep", "train-tokenizer", "--input", str(corpus), "--output-prefix", str(tok),
                        "--vocab-size", "8192", "--sample-docs", "3000"], check=True, cwd=REPO)
    if not Path(f"{prefix}.idx").exists():
        subprocess.run([py, "-m", "dataprep", "text", "--input", str(corpus), "--output-prefix", str(prefix),
                        "--tokenizer", f"{tok}.model", "--append-eod", "--progress", "never"], check=True, cwd=REPO)
    return prefix


def plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Loss curves as a PNG drawn with Pillow: axes, ticks, one polyline per run, a legend."""
    from PIL import Image, ImageDraw

    W, H, L, R, T, B = 900, 560, 70, 20, 40, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    steps = max(len(v) for v in curves.values())
    lo = min(min(v) for v in curves.values())
    hi = max(v[min(5, len(v) - 1)] for v in curves.values())  # clip the first steps' loss: the tail matters

    def x(i: int) -> float:
        return L + (W - L - R) * i / max(steps - 1, 1)

    def y(v: float) -> float:
        return T + (H - T - B) * (hi - min(v, hi)) / max(hi - lo, 1e-9)
    d.rectangle([L, T, W - R, H - B], outline="black")
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        d.line([L - 4, y(v), L, y(v)], fill="black")
        d.text((5, y(v) - 6), f"{v:.2f}", fill="black")
        s = round((steps - 1) * k / 5)
        d.line([x(s), H - B, x(s), H - B + 4], fill="black")
        d.text((x(s) - 10, H - B + 8), str(s + 1), fill="black")
    d.text((W // 2 - 20, H - 18), "step", fill="black")
    d.text((L, 12), title, fill="black")
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for n, (name, losses) in enumerate(curves.items()):
        d.line([(x(i), y(v)) for i, v in enumerate(losses)], fill=colors[n % 4], width=2)
        d.line([W - 230, T + 15 + 18 * n, W - 200, T + 15 + 18 * n], fill=colors[n % 4], width=3)
        d.text((W - 195, T + 9 + 18 * n), f"{name}: {losses[-1]:.4f}", fill="black")
    tmp = path.with_suffix(".tmp.png")
    img.save(tmp)
    tmp.rename(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--work", default="/tmp/mmtrain-fp8-conv", help="corpus, tokenizer and shards")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--recipes", nargs="*", default=["delayed", "tensorwise"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--max-docs", type=int, default=100_000)
    ap.add_argument("--tag", default="", help="suffix of the output names (fp8_convergence_TAG.png/.json)")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides",
                    help="extra key=value config overrides (e.g. a smaller model)")
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    prefix = prep(work, a.max_docs)

    import torch

    from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
    from mmtrain.models.llama.model import count_parameters
    from mmtrain.parallel import ParallelDims, init_distributed, pick_device
    from mmtrain.train.loop import train_gpt
    from mmtrain.utils.log import setup_logging

    runs = [("bf16", ["train.precision=bf16"])]
    runs += [(f"fp8 {r}", ["train.precision=fp8", f"fp8.recipe={r}", *(["fp8.format=e4m3"] if r == "rowwise" else [])])
             for r in a.recipes]
    device = pick_device("auto")
    rank, world = init_distributed("auto" if device.type == "cuda" else "gloo", device)
    setup_logging(rank)
    curves: dict[str, list[float]] = {}
    for name, extra in runs:
        cfg = load_config(GPTRunConfig, None, [
            *MODEL, f"data.prefixes=[{prefix}]", f"data.seq_length={a.seq}", f"train.micro_batch_size={a.batch}",
            f"train.steps={a.steps}", "optim.lr=6e-4", "optim.min_lr=6e-5", "optim.warmup_steps=30",
            f"train.compile={str(a.compile).lower()}", f"logging.run_dir={work}/runs/{name.replace(' ', '_')}",
            "logging.log_every=25", "checkpoint.save_final=false", "data.split=100,0,0", *extra, *a.overrides])
        validate_gpt_config(cfg, world)
        if name == "bf16":
            print(f"model: {count_parameters(cfg.model) / 1e6:.1f}M parameters; {a.steps} steps x {a.batch} x "
                  f"{a.seq} tokens", flush=True)
        mesh = ParallelDims.from_config(cfg.parallel, world).build()
        torch.manual_seed(0)
        curves[name] = train_gpt(cfg, mesh, device).losses
    base = curves["bf16"]
    tail = max(1, len(base) // 30)  # the final loss as the mean of the last ~10 steps (less batch noise)
    final = {k: sum(v[-tail:]) / tail for k, v in curves.items()}
    print(json.dumps({"losses": {k: [round(x, 4) for x in v] for k, v in curves.items()}}))
    for k, v in final.items():
        diff = (v - final["bf16"]) / final["bf16"]
        print(f"{k:>16}: final loss (mean of last {tail}) {v:.4f}, relative to bf16 {diff:+.2%}"
              f"{'' if k == 'bf16' else ('  (within 2%)' if abs(diff) <= 0.02 else '  (NOT within 2%)')}")
    stem = f"fp8_convergence{'_' + a.tag if a.tag else ''}"
    png = out / f"{stem}.png"
    plot(curves, png, f"{count_parameters(cfg.model) / 1e6:.0f}M model, stdlib tokens, seq {a.seq}, batch {a.batch}")
    (out / f"{stem}.json").write_text(json.dumps({"final": final, "losses": curves}) + "\n")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
