"""What a prefill of a new shape costs: the engine's eager prefill (Llama-3.2-1B shapes, random weights, bf16) of
B prompts of S tokens, timed at its first call for that (B, S) and again, with each scaled_dot_product_attention
kernel choice.

    python bench/prefill_shapes.py [--shapes 1x128 7x128 32x128 ...] [--tiny] [--device cpu]

A server prefills whatever joined since its last step: the batch size and the longest prompt change from call to
call. A kernel that prepares itself per shape (cuDNN's attention builds and caches an execution plan) pays that
again for every new (B, S); this prints how much, as a table:

| attention | shape | first call ms | again ms |

Modes: "mmtrain", the tree's cached attention (a prefill from position 0 attends causally without a mask:
``mmtrain.model.kv_cache.from_start_attention``, flash on a GPU); "masked, no cuDNN", the masked attention
every prefill ran before (key index <= query position) with flash, memory-efficient and math allowed; "masked
(before)", the same with every kernel allowed (PyTorch picks cuDNN on an H100/H200: the tree before). One
warm-up call of another shape comes first, and the masked modes run after, so the shared cuBLAS warm-up of a new
shape favours them. Before the table, one line per SDPA kernel alone: whether it takes a prefill's call (a
boolean mask or is_causal, with grouped-query heads).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.generate import build_model  # noqa: E402
from mmtrain.inference.decoder import decoder_forward, kv_cache_for  # noqa: E402
from mmtrain.model import layers  # noqa: E402

ALL = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MODES = {  # name: (masked attention?, the kernels allowed)
    "mmtrain": (False, ALL),
    "masked, no cuDNN": (True, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
    "masked (before)": (True, ALL),
}


def _shape(text: str) -> tuple[int, int]:
    b, s = text.lower().split("x")
    return int(b), int(s)


def _masked(q_BSHD, keys_BHTD, values_BHTD, key_index_T, positions_BS, scale=None, window=None, **_):
    """The cached attention every prefill ran before: a boolean mask, key index <= query position."""
    visible = key_index_T[None, None, None, :] <= positions_BS[:, None, :, None]
    q = q_BSHD.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys_BHTD.to(q.dtype), values_BHTD.to(q.dtype), attn_mask=visible,
                                         scale=scale, enable_gqa=q.shape[1] != keys_BHTD.shape[1])
    return out.transpose(1, 2)


def _kernels_alone(device: torch.device, dtype: torch.dtype) -> None:
    q = torch.randn(2, 32, 128, 64, device=device, dtype=dtype)
    kv = torch.randn(2, 8, 128, 64, device=device, dtype=dtype)
    mask = torch.ones(128, 128, dtype=torch.bool, device=device).tril()[None, None].expand(2, 1, 128, 128)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        for what, kwargs in (("mask", dict(attn_mask=mask)), ("is_causal", dict(is_causal=True))):
            try:
                with warnings.catch_warnings(), sdpa_kernel([backend]):
                    warnings.simplefilter("ignore")
                    F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, **kwargs)
                verdict = "takes it"
            except RuntimeError as exc:
                verdict = "refuses: " + str(exc).strip().splitlines()[0][:100]
            print(f"kernel {backend.name}, grouped heads, {what}: {verdict}", flush=True)


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[_shape(s) for s in ("1x128", "7x128", "25x128", "32x128", "32x97", "3x300")])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    device = torch.device(a.device)
    model = build_model(a.tiny, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    slots = max(b for b, _ in a.shapes)
    cache = kv_cache_for(model, slots, max(s for _, s in a.shapes) + 1, model.embed.weight.dtype, device)
    vocab = model.cfg.vocab_size
    _kernels_alone(device, model.embed.weight.dtype)
    rows = []
    tree = layers.cached_attention

    def prefill(b: int, s: int, kernels) -> float:
        tokens = torch.randint(0, vocab, (b, s), device=device)
        positions = torch.arange(s, device=device).expand(b, s)
        slots_b, last = torch.arange(b, device=device), torch.full((b,), s - 1, device=device)

        def call():
            with sdpa_kernel(kernels):
                decoder_forward(model, cache, positions, tokens_BS=tokens, slots_B=slots_b, last_index_B=last,
                                kv_len=s)

        first = _timed(call, device)
        return first, min(_timed(call, device) for _ in range(3))

    with torch.no_grad():
        prefill(2, 16, ALL)  # the process's first call (cuBLAS handles, allocator) outside the table
        for name, (masked, kernels) in MODES.items():
            layers.cached_attention = _masked if masked else tree
            for b, s in a.shapes:
                first, again = prefill(b, s, kernels)
                rows.append((name, f"{b}x{s}", first, again))
                print(f"{name} {b}x{s}: first {first:.1f} ms, again {again:.1f} ms", flush=True)
        layers.cached_attention = tree
    print("### table")
    print("| attention | shape (prompts x tokens) | first call ms | again ms |")
    print("|---|---|---|---|")
    for name, shape, first, again in rows:
        print(f"| {name} | {shape} | {first:.1f} | {again:.1f} |")


if __name__ == "__main__":
    main()
