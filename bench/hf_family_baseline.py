"""The Hugging Face anchor for any mmtrain model family: transformers' own model of exactly the shape of an mmtrain
model config, trained on the same samples as ``bench/train_gpt.py`` reads, one JSON line last.

    python bench/hf_family_baseline.py --model configs/models/qwen3-1.7b.yaml [--batch 4] [--seq 4096]
        [--data PREFIX] [--compile] [key=value ...]

The HF config comes from the family's own HF adapter (``config_to_hf``, what ``mmtrain-to-hf`` writes), so the
two models have the same parameters; transformers builds it with ``AutoModelForCausalLM.from_config`` in bf16 with
its SDPA attention where the class supports it (else its default), and trains it with fused AdamW, as a user of
transformers would on one GPU. Samples: mmtrain's own dataset for the run (``--data``: ``mmtrain-prep text``
output; default mock tokens), batch by batch in the same order. The FLOP count is the mmtrain family's (the same
numerator for both rows), MFU against the measured H200 bf16 ceiling. The JSON line names the transformers
version, and for a model with Mamba mixers (Nemotron-H) which scan transformers ran ("mamba": mamba-ssm's kernels
when that package imports, else its PyTorch path).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.models.registry import model_family  # noqa: E402

BF16_CEILING_TFLOPS = 736.0


def hf_model(cfg: GPTRunConfig, compile_model: bool):
    """transformers' model of ``cfg.model``'s shape (random init, bf16, on the GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_family(cfg.model).hf.config_to_hf(cfg.model, None))
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf_config.use_cache = False
    torch.manual_seed(0)
    for attention in ("sdpa", None):  # SDPA where the class has it (GPT-OSS's sinks need its own kernels)
        try:
            kwargs = {"attn_implementation": attention} if attention else {}
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, **kwargs)
            break
        except (ValueError, ImportError):
            continue
    model = model.to("cuda")
    model.train()
    implementation = model.config._attn_implementation
    return (torch.compile(model) if compile_model else model), implementation


def mamba_path(hf_config) -> str | None:
    """Which scan a model with Mamba mixers (Nemotron-H) runs in transformers: mamba-ssm's kernels when that package
    imports, else its own PyTorch chunked scan (no hub kernels: ``use_kernels`` is not asked for); None without
    Mamba mixers."""
    if not hasattr(hf_config, "mamba_num_heads"):
        return None
    # imported, not just found: a mamba-ssm built without its CUDA extension (what mmtrain's hybrid loads its
    # Triton kernels from) is found, but its package import fails, and transformers then takes its PyTorch path
    try:
        importlib.import_module("mamba_ssm")
    except Exception:  # noqa: BLE001 - any failure of the package import is transformers' fallback
        return "PyTorch"
    return "mamba-ssm kernels"


def batches(cfg: GPTRunConfig, batch: int):
    """(inputs, labels) of the run's training samples in order, ``batch`` at a time."""
    if cfg.data.mock:
        from mmtrain.data.mock import MockGPTSamples

        samples = MockGPTSamples(cfg.model.shape().vocab_size, cfg.data.seq_length, cfg.data.seed)
    else:
        from mmtrain.data.blend import build_gpt_samples_from_config

        samples = build_gpt_samples_from_config(cfg, "train", 1)
    index = 0
    while True:
        rows = torch.stack([torch.as_tensor(samples[index + i]).long() for i in range(batch)]).cuda()
        index += batch
        yield rows[:, :-1], rows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--data", help="indexed-dataset prefix from mmtrain-prep text (default: mock tokens)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole HF model")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    data = ["data.mock=true"] if not a.data else ["data.mock=false", f"data.prefixes=[{a.data}]", "data.split=100,0,0"]
    cfg = load_config(GPTRunConfig, a.model, [*data, f"data.seq_length={a.seq}", *a.overrides])
    torch.backends.cuda.matmul.allow_tf32 = True
    model, implementation = hf_model(cfg, a.compile)
    mamba = mamba_path(model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    feed = batches(cfg, a.batch)
    times, loss = [], None
    for step in range(a.warmup + a.steps):
        inputs, labels = next(feed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    dt = statistics.median(times)
    tps = a.batch * a.seq / dt
    tflops = tps * model_family(cfg.model).flops_per_token(cfg.model, a.seq) / 1e12
    print(json.dumps({"system": "hf-transformers" + ("-compiled" if a.compile else ""), "model": cfg.model.shape().name,
                      "attention": implementation, "seq": f"{a.batch}x{a.seq}", "tokens_per_s": round(tps),
                      "step_ms": round(1000 * dt, 1), "model_tflops": round(tflops, 1),
                      "mfu": round(tflops / BF16_CEILING_TFLOPS, 3),
                      "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                      "loss": round(loss.item(), 4), "transformers": transformers.__version__,
                      **({"mamba": mamba} if mamba else {})}), flush=True)


if __name__ == "__main__":
    main()
