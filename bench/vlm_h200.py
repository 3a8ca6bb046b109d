"""~2B VLM training throughput on H200s (synthetic image-caption batches), one table + one JSON line per run.

    python bench/vlm_h200.py [--batch 8] [--seq 1024] [--steps 8] [--warmup 3] [--compile] [key=value ...]
    torchrun --nproc_per_node 2 bench/vlm_h200.py            # DP2

Runs the real VLM training loop (``mmtrain.train.vlm_train.train_vlm``: DP buckets, distributed optimizer with fp32
masters, clipping, LR schedule) on ``configs/vlm/vlm_2b.yaml`` (SigLIP-so400m-shaped ViT at 448 px + Qwen2.5-1.5B-
shaped LM) with ``data.mock=true``: synthetic ``MediaBatch``-es, one image and ``seq - 256`` caption tokens per
sample, so neither megatron-energon nor webdataset is needed on the GPU machine. Reports the median timed step:
images/s and tokens/s per GPU, model TFLOP/s per GPU (LM: 6N + causal attention per token, as the GPT bench;
ViT + projector: 6 x weights per patch + bidirectional attention per image), MFU against the measured H200 bf16
ceiling (736 TFLOP/s, the project's convention) and against the 989 TFLOP/s dense datasheet peak, peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import load_config  # noqa: E402
from mmtrain.config.vlm_run_schema import VLMRunConfig  # noqa: E402
from mmtrain.config.vlm_validate import validate_vlm_config  # noqa: E402
from mmtrain.models.llama.model import flops_per_token  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed  # noqa: E402
from bench.profile_summary import host_profiling, profiling, summarize  # noqa: E402
from mmtrain.utils.atomic import atomic_write_text  # noqa: E402
from mmtrain.train.vlm_train import train_vlm, vision_flops_per_image  # noqa: E402
from mmtrain.utils.log import setup_logging  # noqa: E402

BF16_CEILING_TFLOPS = 736.0  # measured dense bf16 matmul ceiling of one H200 (bench/train_gpt.py)
BF16_PEAK_TFLOPS = 989.0  # datasheet dense bf16


def count(model, prefix: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs/vlm/vlm_2b.yaml"))
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size (samples = images) per data-parallel rank")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="train.compile=true (each ViT and LM block)")
    ap.add_argument("--label", default="mmtrain-vlm")
    ap.add_argument("--profile", help="write the last two timed steps' profile summary (markdown) to this file")
    ap.add_argument("--host-profile", help="write a cProfile table of the first two steps after warmup to this "
                    "file (where the host's time goes; those steps are left out of the timing)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(VLMRunConfig, a.config, [
        "data.mock=true", f"data.seq_length={a.seq}", f"train.micro_batch_size={a.batch}",
        f"train.steps={a.steps + a.warmup}", "optim.warmup_steps=1", "logging.run_dir=/tmp/mmtrain-bench-vlm",
        "logging.log_every=1", "checkpoint.save_final=false", f"train.compile={str(a.compile).lower()}",
        *a.overrides])
    validate_vlm_config(cfg, world)
    device = pick_device(cfg.train.device)
    rank, world = init_distributed(cfg.parallel.backend, device)
    setup_logging(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    profiled = 2 if a.profile else 0
    hosted = 2 if a.host_profile else 0
    with (profiling(a.warmup + a.steps - profiled, profiled) as prof,
          host_profiling(a.warmup, hosted, a.host_profile)):
        result = train_vlm(cfg, mesh, device)
    dt = statistics.median(result.step_times[a.warmup + hosted:len(result.step_times) - profiled])
    if prof is not None and rank == 0:
        wall = statistics.fmean(result.step_times[-profiled:]) * 1000
        atomic_write_text(Path(a.profile), f"## {a.label}: {a.batch}x{a.seq} {' '.join(a.overrides)}\n\n"
                                   + summarize(prof, profiled, wall))
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * mesh.dims.dp
    images_per_s = gbs / dt / world  # mock data: one image per sample
    tokens_per_s = gbs * cfg.data.seq_length / dt / world
    lm_tflops = tokens_per_s * flops_per_token(cfg.model.language, cfg.data.seq_length) / 1e12
    vit_tflops = images_per_s * vision_flops_per_image(cfg.model) / 1e12
    tflops = lm_tflops + vit_tflops
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    model = result.model
    if rank == 0:
        row = {"system": a.label, "layout": mesh.dims.describe(), "compile": a.compile, "overrides": a.overrides,
               "params_vision_M": round(count(model, "vision.") / 1e6, 1),
               "params_projector_M": round(count(model, "projector.") / 1e6, 1),
               "params_language_M": round(count(model, "language.") / 1e6, 1),
               "micro_batch": cfg.train.micro_batch_size, "seq": cfg.data.seq_length,
               "image_px": cfg.model.vision.image_size, "tokens_per_image": cfg.model.tokens_per_image,
               "step_ms": round(1000 * dt, 1), "images_per_s": round(images_per_s, 1),
               "tokens_per_s": round(tokens_per_s), "tflops": round(tflops, 1), "tflops_vit": round(vit_tflops, 1),
               "tflops_lm": round(lm_tflops, 1), "mfu": round(tflops / BF16_CEILING_TFLOPS, 3),
               "mfu_vs_989": round(tflops / BF16_PEAK_TFLOPS, 3), "peak_mem_gib": round(mem, 1),
               "loss_first": round(result.losses[0], 3), "loss_last": round(result.losses[-1], 3)}
        table = [("model", f"ViT {row['params_vision_M']}M + projector {row['params_projector_M']}M + LM "
                           f"{row['params_language_M']}M"),
                 ("layout / compile", f"{row['layout']} / {a.compile}"),
                 ("batch per GPU", f"{row['micro_batch']} x {row['seq']} tokens, 1 image "
                                   f"({row['image_px']} px, {row['tokens_per_image']} tokens) per sample"),
                 ("step", f"{row['step_ms']} ms"), ("images/s per GPU", row["images_per_s"]),
                 ("tokens/s per GPU", row["tokens_per_s"]),
                 ("TFLOP/s per GPU", f"{row['tflops']} (ViT {row['tflops_vit']} + LM {row['tflops_lm']})"),
                 ("MFU", f"{100 * row['mfu']:.1f}% of 736 (measured ceiling), {100 * row['mfu_vs_989']:.1f}% of 989"),
                 ("peak memory", f"{row['peak_mem_gib']} GiB"),
                 ("loss", f"{row['loss_first']} -> {row['loss_last']}")]
        print("\n| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in table), flush=True)
        print(json.dumps(row), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
