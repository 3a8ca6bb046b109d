"""``fp8.param_gather`` on GPUs (2+ ranks, NCCL): that it equals the BF16 gather, and what the gather costs.

    torchrun --nproc_per_node 2 bench/fp8_param_gather.py [--check-only | --time-only] [--iters 20]

1. check: a small model, compiled, native tensorwise FP8 with the FP8 output layer, dp=2 distributed optimizer,
   6 steps of ``train_gpt`` with ``fp8.param_gather`` off and on: the losses must be equal, the FP8 weight
   copies (W, W^T, inverse scales) bit-identical, the BF16 weights after the run identical.
2. time: Llama-3.2-1B shapes (configs/models/llama3.2-1b.yaml), this rank's FP8 buckets: the BF16 all-gather
   of those buckets plus the re-cast of every FP8 weight from BF16 (what each step does without the option)
   vs the FP8 gather (amax, cast of the owned pieces, one-byte all-gather, W^T), median ms over ``--iters``.
One JSON line per part on rank 0 (``bash bench/h200x2_fp8_param_gather.sh`` adds the step throughput on/off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.model import fp8_param_gather  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device  # noqa: E402
from mmtrain.parallel.grad_buckets import GradBuckets  # noqa: E402
from mmtrain.train.optimizer import MixedPrecisionAdamW  # noqa: E402
from mmtrain.train.build import build_gpt_stage  # noqa: E402
from mmtrain.train.loop import train_gpt  # noqa: E402

SMALL = ["model.num_layers=4", "model.hidden_size=512", "model.ffn_hidden_size=1536", "model.num_attention_heads=8",
         "model.num_query_groups=4", "model.vocab_size=4096", "data.mock=true", "data.seq_length=512",
         "train.steps=6", "train.micro_batch_size=4", "train.global_batch_size=16", "optim.lr=1e-3",
         "optim.warmup_steps=1", "checkpoint.save_final=false", "train.compile=true", "train.precision=fp8",
         "fp8.backend=native", "fp8.recipe=tensorwise", "fp8.output_layer=true"]
COPIES = ("w_a", "w_b", "w_a_inv", "w_b_inv")


def check(world: int, device: torch.device) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):
            cfg = load_config(GPTRunConfig, None, [*SMALL, f"parallel.dp={world}",
                                                   f"fp8.param_gather={str(on).lower()}", f"logging.run_dir={tmp}/{on}"])
            mesh = ParallelDims.from_config(cfg.parallel, world).build()
            result = train_gpt(cfg, mesh, device)
            rt = result.model.fp8_runtime
            rt.refresh([m for m in rt.matmuls if m.weight_stale])  # the off run casts at the next forward
            out[on] = (result.losses, [[getattr(m, k).clone() for k in COPIES] for m in rt.matmuls],
                       [p.detach().clone() for p in result.model.parameters()],
                       None if rt.param_gather is None else rt.param_gather.fp8_gathers)
            del result
            torch._dynamo.reset()
    (l0, c0, p0, _), (l1, c1, p1, gathers) = out[False], out[True]
    copies_equal = all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b)
                       for x, y in zip(c0, c1) for a, b in zip(x, y))
    return {"part": "check", "losses_off": l0, "losses_on": l1, "losses_equal": l0 == l1,
            "fp8_copies_bit_equal": copies_equal, "bf16_params_equal": all(torch.equal(a, b) for a, b in zip(p0, p1)),
            "fp8_gathers": gathers}


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def time_gathers(world: int, device: torch.device, iters: int) -> dict:
    cfg = load_config(GPTRunConfig, str(REPO / "configs/models/llama3.2-1b.yaml"), [
        "data.mock=true", "train.precision=fp8", "fp8.backend=native", "fp8.recipe=tensorwise", "fp8.param_gather=true",
        f"parallel.dp={world}"])
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    stage = build_gpt_stage(cfg, mesh, device)
    rt = stage.fp8_runtime
    weights = fp8_param_gather.gather_weights(rt, cfg, world)
    params = [p for p in stage.parameters() if p.requires_grad]
    buckets = GradBuckets(params, mesh.dp_cp_group, True, torch.bfloat16, separate_params=weights)
    MixedPrecisionAdamW([buckets], 1e-4, (0.9, 0.95), 1e-8, 0.1)
    gather = fp8_param_gather.Fp8ParamGather(buckets, rt, mesh.tp_group)
    rt.refresh(rt.matmuls)  # sizes the FP8 copies (the first forward does it in training)
    fp8_buckets = [b for b in buckets.buckets if b.separate]

    def bf16_path():
        for b in fp8_buckets:
            buckets.gather_bucket(b)
        rt.refresh(gather.matmuls)  # what the next forward does without the option (in place, one graph)

    def fp8_path():
        gather.gather()

    elems = sum(p.numel() for b in fp8_buckets for p in b.params)
    return {"part": "time", "fp8_weights": len(gather.matmuls), "elements": elems, "dp": world,
            "bf16_gather_and_cast_ms": round(_median_ms(bf16_path, iters), 3),
            "fp8_gather_ms": round(_median_ms(fp8_path, iters), 3),
            "bytes_gathered_bf16": 2 * elems, "bytes_gathered_fp8": elems}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = pick_device()
    init_distributed("nccl", device)
    world = dist.get_world_size()
    parts = []
    if not args.time_only:
        parts.append(check(world, device))
    if not args.check_only:
        parts.append(time_gathers(world, device, args.iters))
    if int(os.environ.get("RANK", "0")) == 0:
        for p in parts:
            print(json.dumps(p), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
