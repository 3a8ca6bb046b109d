"""KV-cache generation speed: Llama-3.2-1B shapes (random weights), bf16, greedy, 128-token prompts, 256 new tokens.

    python bench/generate.py [--batch 1 32] [--prompt 128] [--new 256] [--no-compile] [--tiny] [--device cpu]
                             [--family deepseek_v3] [--temperature T]

The same settings as ../shared/bench/hf_generate_baseline.py (its LlamaConfig: 16 layers, width 2048, 32 heads, 8
KV heads, FFN 8192, vocabulary 128256, tied embeddings, rope theta 5e5): each batch size is warmed up at the timed
shapes (compilation and CUDA-graph capture happen there), then one whole generation (prefill + every decode step)
is timed. tokens_per_s counts new tokens only; the first step (the prefill of every prompt, its tokens read
back) is also given alone, and the decode steps after it per step. Prints one JSON line per setting, then a
table. ``--tiny`` shrinks the model (a CPU check that the script runs). ``--family deepseek_v3``:
DeepSeek-V2-Lite shapes instead (27 MLA layers, width 2048, 16 heads, kv_lora_rank 512, 64 routed experts of
which 6 per token plus 2 shared, 15.7B parameters, 2.7B active with the embeddings; the latent KV cache), random
normal weights (std 0.02), so routing is random too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.models.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from mmtrain.config.schema import ModelConfig  # noqa: E402
from mmtrain.inference.engine import COMPILE_MODES, DecodeEngine, Sequence, generate  # noqa: E402
from mmtrain.inference.loading import prepare_for_decoding  # noqa: E402
from mmtrain.inference.sampling import SamplingParams  # noqa: E402
from mmtrain.models.deepseek_v3.model import DeepseekV3Model  # noqa: E402
from mmtrain.models.llama.model import GPTModel  # noqa: E402

LLAMA_1B = dict(name="llama3.2-1b-shapes", num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                num_attention_heads=32, num_query_groups=8, vocab_size=128256, rope_theta=500000.0,
                tie_embeddings=True)
TINY = dict(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, vocab_size=512, tie_embeddings=True)


DEEPSEEK_V2_LITE = dict(name="deepseek-v2-lite-shapes", vocab_size=102400, hidden_size=2048, num_layers=27,
                        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944, first_k_dense_replace=1,
                        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                        moe_intermediate_size=1408, routed_scaling_factor=1.0, norm_topk_prob=False)
DEEPSEEK_TINY = dict(name="deepseek-tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                     q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     intermediate_size=128, n_routed_experts=8, n_group=1, topk_group=1, moe_intermediate_size=32)


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype, family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        if family == "deepseek_v3":
            model = DeepseekV3Model(DeepseekV3Config(**(DEEPSEEK_TINY if tiny else DEEPSEEK_V2_LITE)))
            with torch.no_grad():  # experts start as torch.empty: random normal weights, norms at one
                for p in model.parameters():
                    if p.ndim == 1:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02)
        else:
            model = GPTModel(ModelConfig(**(TINY if tiny else LLAMA_1B)))
    return prepare_for_decoding(model, device, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generation(model: torch.nn.Module, batch: int, prompt: int, new: int, compile: bool, device: torch.device,
                    warmup: int = 2, compile_mode: str = "reduce-overhead",
                    before_timing: Callable[[], None] | None = None, temperature: float = 0.0) -> dict:
    """``before_timing``: called between the warm-up and the timed run (bench/quant_accuracy.py waits there for
    its turn on the GPU, so several processes compile at once and time one at a time). ``temperature`` > 0: every
    row sampled from its own seeded stream (as GRPO's rollouts draw), else greedy."""
    torch._dynamo.reset()  # each setting compiles its own step
    engine = DecodeEngine(model, batch, prompt + new, compile=compile, compile_mode=compile_mode)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, model.cfg.vocab_size - 1, (batch, prompt), generator=g).tolist()
    params = [SamplingParams(max_new_tokens=new, temperature=temperature, seed=i if temperature > 0 else None)
              for i in range(batch)]  # no stop tokens: every row runs all `new` steps
    t0 = time.perf_counter()
    for _ in range(warmup):
        generate(engine, prompts, params)
    _sync(device)
    warm_s = time.perf_counter() - t0
    if before_timing is not None:
        before_timing()
    # generate()'s loop, with the first step (every prompt joins: the prefill, whose tokens are read back) timed
    # apart from the decode steps after it
    seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
    t0 = time.perf_counter()
    for s in seqs:
        engine.submit(s)
    engine.step()
    prefill_s = time.perf_counter() - t0
    while engine.busy:
        engine.step()
    _sync(device)
    dt = time.perf_counter() - t0
    n = min(len(s.token_ids) for s in seqs)
    return {"system": "mmtrain-generate", "compile": compile_mode if compile else False, "batch": batch,
            "temperature": temperature, "prompt": prompt, "new_tokens": n,
            "s": round(dt, 3), "tokens_per_s": round(batch * n / dt), "ms_per_step": round(1000 * dt / n, 3),
            "prefill_ms": round(1000 * prefill_s, 2),
            "decode_ms_per_step": round(1000 * (dt - prefill_s) / max(n - 1, 1), 3),
            "warmup_s": round(warm_s, 1),
            "peak_mem_gib": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                             if device.type == "cuda" else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="eager decode step (no torch.compile / CUDA graphs)")
    ap.add_argument("--eager-too", action="store_true", help="also time the eager decode step")
    ap.add_argument("--tiny", action="store_true", help="tiny model (a CPU check of the script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--family", choices=("llama", "deepseek_v3"), default="llama")
    ap.add_argument("--compile-modes", nargs="+", default=["reduce-overhead"], choices=list(COMPILE_MODES),
                    help="inductor settings of the compiled step to time, each at every batch size")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sample every row from its own seeded stream (GRPO's rollouts); 0: greedy")
    a = ap.parse_args()
    device = torch.device(a.device)
    model = build_model(a.tiny, device, torch.bfloat16 if a.dtype == "bf16" else torch.float32, a.family)
    modes = [] if a.no_compile else list(a.compile_modes)
    modes += [None] if a.no_compile or a.eager_too else []  # None: eager
    rows = []
    for mode in modes:
        for batch in a.batch:
            try:
                row = time_generation(model, batch, a.prompt, a.new, mode is not None, device,
                                      compile_mode=mode or "reduce-overhead", temperature=a.temperature)
            except Exception as exc:  # noqa: BLE001 - one failing setting costs only its own line
                row = {"system": "mmtrain-generate", "compile": mode or False, "batch": batch,
                       "error": repr(exc)[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| system | model | compiled | batch | new tokens/s | ms/step | prefill ms | decode ms/step |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| mmtrain | {model.cfg.name} | {r['compile']} | {r['batch']} | {r.get('tokens_per_s', 'error')} "
              f"| {r.get('ms_per_step', '-')} | {r.get('prefill_ms', '-')} | {r.get('decode_ms_per_step', '-')} |")


if __name__ == "__main__":
    main()
