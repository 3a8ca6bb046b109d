"""What Inductor makes of one FP8 transformer block, on the CPU (no GPU needed): compiles a tiny block (every
dimension a multiple of 16) in BF16 and with the native FP8 linears, runs forward + backward, and counts the
generated kernels (fused loops), the extern GEMMs and the buffers each graph reads and writes, per graph.

    PYTHONPATH=. python bench/fp8_cpu_kernels.py [--recipes bf16 tensorwise delayed] [--dump DIR] [key=value ...]

The CPU's C++ kernels are not Triton's, but the fusion decisions (which nodes share a loop, which tensors are
materialized) come from the same scheduler, so the counts show where the FP8 casts, amaxes and transposes go.
Extra ``key=value`` arguments are config overrides (e.g. ``fp8.fast_accum_backward=true``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.model.fp8 import apply_native_fp8
from mmtrain.model.fp8_native import Fp8Matmul
from mmtrain.models.llama.model import GPTModel
from mmtrain.model.layers import rope_cos_sin, rope_frequencies

SHAPE = ["data.mock=true", "train.device=cuda", "model.num_layers=1", "model.hidden_size=64",
         "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=64"]


def summarize(code: str) -> dict:
    """Kernels and extern calls of one generated module."""
    kernels = re.findall(r"^cpp_fused_\w+ = ", code, flags=re.MULTILINE) or re.findall(r"def (triton_\w+)\(", code)
    call = code[code.find("def call("):]
    sources = dict(re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(.*?r\'\'\'(.*?)\'\'\'\)", code,
                              flags=re.MULTILINE | re.DOTALL))
    called = re.findall(r"(cpp_fused_\w+)\(", call)
    # a parallel loop nest ("#pragma omp for") is one pass over a tensor; with the tiny-scalar "omp single" blocks
    # left out, this counts the passes over activation-sized memory
    passes = sum(sources.get(name, "").count("#pragma omp for") for name in called)
    return {"kernels": len(kernels), "passes": passes,
            "names": called,
            "scaled_mm": len(re.findall(r"extern_kernels\._scaled_mm\(", call)),
            "mm": len(re.findall(r"extern_kernels\.(?:mm|bmm|addmm)\(", call)),
            "other_aten": sorted(set(re.findall(r"torch\.ops\.aten\.(\w+)", call)) - {"_scaled_mm"})}


def run(recipe: str, extra: list[str], dump: Path | None) -> list[dict]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = load_config(GPTRunConfig, None, [*SHAPE, *(["train.precision=fp8", "fp8.backend=native",
                                                      f"fp8.recipe={recipe}"] if recipe != "bf16" else []), *extra])
    model = GPTModel(cfg.model).to(torch.bfloat16)
    model.init_weights(1)
    if recipe != "bf16":
        apply_native_fp8(model, cfg)
    block = model.layers["0"]
    for m in block.modules():
        if isinstance(m, Fp8Matmul):
            m.refresh_weight(m.weight_ref)
            if recipe == "delayed":  # after the first update: known scales
                m.delayed_ready = True
                m.scales.copy_(torch.tensor([8.0, 1024.0]))
    B, S, D = 2, 32, cfg.model.hidden_size
    inv_freq = rope_frequencies(D // cfg.model.num_attention_heads, cfg.model.rope_theta)
    cos, sin = rope_cos_sin(torch.arange(S).expand(B, S), inv_freq, torch.bfloat16)
    x = torch.randn(B, S, D, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)

    def step():
        y = compiled(x, cos, sin)
        y.backward(torch.randn_like(y))

    _, codes = run_and_get_code(step)
    out = []
    for i, code in enumerate(codes):
        if dump:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{recipe}_{i}.py").write_text(code)
        out.append(summarize(code))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="*", default=["bf16", "tensorwise", "delayed"])
    ap.add_argument("--dump", type=Path, default=None, help="write each generated module here")
    ap.add_argument("--summarize", type=Path, default=None, help="only summarize the modules dumped in this folder")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.summarize:
        for path in sorted(a.summarize.glob("*.py")):
            s = summarize(path.read_text())
            print(f"{path.stem:14s} kernels {s['kernels']:2d}  loop passes {s['passes']:2d}")
        return
    for recipe in a.recipes:
        for name, s in zip(("forward", "backward"), run(recipe, a.overrides, a.dump)):
            print(f"{recipe:10s} {name:8s} kernels {s['kernels']:2d}  loop passes {s['passes']:2d}  _scaled_mm {s['scaled_mm']}  mm {s['mm']}  "
                  f"other aten {s['other_aten']}", flush=True)
            print(f"{'':19s} {' '.join(n.removeprefix('cpp_fused_') for n in s['names'])}", flush=True)


if __name__ == "__main__":
    main()
