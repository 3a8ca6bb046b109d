"""A weights-only checkpoint of random weights for a model shape (a distillation teacher for speed figures: a random
teacher costs what a trained one does).

    python bench/random_checkpoint.py --model configs/models/llama3-8b.yaml --out DIR [--tokenizer TOK] [key=value ...]

Weights: norms 1, the rest N(0, 0.02), bf16, drawn on ``--device`` (fast on a GPU) and written by the product's
``write_weights_checkpoint`` (DCP files + ``complete.json`` + ``latest``); the model is never built, only its
parameter names and shapes (on the meta device). Prints the parameter count and the seconds taken.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.convert.checkpoint_io import write_weights_checkpoint  # noqa: E402
from mmtrain.core.tokenizer import load_tokenizer  # noqa: E402
from mmtrain.models.registry import model_family  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model config (configs/models/*.yaml)")
    ap.add_argument("--out", required=True, help="checkpoints root to write")
    ap.add_argument("--tokenizer", default=None, help="the tokenizer to record in complete.json (distillation "
                    "checks that the teacher's is the student data's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (model.vocab_size=N: the student's)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cfg = load_config(GPTRunConfig, a.model, a.overrides).model
    with torch.device("meta"):  # names and shapes only
        stage = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True)
        shapes = {name: t.shape for name, t in stage.state_dict().items()}
    g = torch.Generator(device=a.device).manual_seed(0)
    full = {name: torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else
            (0.02 * torch.randn(shape, device=a.device, dtype=torch.bfloat16, generator=g)).cpu()
            for name, shape in shapes.items()}
    meta = {"tokenizer": load_tokenizer(a.tokenizer).describe()} if a.tokenizer else None
    write_weights_checkpoint(a.out, full, cfg, extra_meta=meta)
    print(f"{sum(t.numel() for t in full.values()) / 1e9:.2f}B parameters written to {a.out} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
