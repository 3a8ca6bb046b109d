"""DeepSeek-V3-style model training throughput on one device (no parallelism), one JSON line per run.

    python bench/deepseek_v3_tokens.py [--model configs/models/deepseek-v3-tiny.yaml] [--batch 4] [--seq 512] \\
        [model.key=value ...]
    # e.g. a DeepSeek-V2-Lite-like width on one H200:
    python bench/deepseek_v3_tokens.py --batch 2 --seq 4096 model.hidden_size=2048 model.num_layers=4 \\
        model.num_attention_heads=16 model.q_lora_rank=null model.kv_lora_rank=512 model.qk_nope_head_dim=128 \\
        model.qk_rope_head_dim=64 model.v_head_dim=128 model.n_routed_experts=64 model.num_experts_per_tok=6 \\
        model.n_shared_experts=2 model.moe_intermediate_size=1408 model.intermediate_size=10944 \\
        model.n_group=1 model.topk_group=1 model.vocab_size=102400

Times forward + backward + AdamW steps (bf16 weights on CUDA, fp32 on CPU) of ``DeepseekV3Model`` on random
tokens and reports the median timed step: tokens/s, model TFLOP/s from ``flops_per_token`` (6 x active
parameters + causal MLA attention) and MFU against ``--peak-tflops`` (default: the measured H200 bf16 ceiling of
bench/train_gpt.py on CUDA; on the CPU MFU is printed only when a peak is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.models.deepseek_v3.shape_file import load_deepseek_v3_config  # noqa: E402
from mmtrain.models.deepseek_v3.flops import count_parameters, flops_per_token  # noqa: E402
from mmtrain.models.deepseek_v3.model import DeepseekV3Model  # noqa: E402

BF16_CEILING_TFLOPS = 736.0  # measured H200 dense bf16 matmul ceiling (bench/train_gpt.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "configs/models/deepseek-v3-tiny.yaml"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--recompute", action="store_true", help="full activation recomputation per layer")
    ap.add_argument("overrides", nargs="*", help="model.key=value")
    args = ap.parse_args()

    cfg = load_deepseek_v3_config(args.model, args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = args.peak_tflops or (BF16_CEILING_TFLOPS if device.type == "cuda" else None)
    model = DeepseekV3Model(cfg)
    model.init_weights(0)
    model.to(device=device, dtype=dtype)
    for layer in model.layers.values():
        layer.set_recompute("full" if args.recompute else "none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_routing_biases()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = args.batch * args.seq / step_s
    tflops = tokens_per_s * flops_per_token(cfg, args.seq) / 1e12
    print(json.dumps({
        "bench": "deepseek_v3_tokens", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "batch": args.batch, "seq": args.seq,
        "params_total": count_parameters(cfg), "params_active": count_parameters(cfg, active=True),
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 2),
        "mfu": round(tflops / peak, 4) if peak else None, "loss": round(loss.item(), 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
