"""The decode step's one-kernel attention (mmtrain/model/decode_attention.py) on the CPU, under Triton's
interpreter (a child process: the interpreter is chosen when Triton is imported): the rotated key and the value
land in the cache where the unfused step writes them, nothing else in the cache changes, and the output equals
RoPE + ``cached_attention`` over the positions up to each row's own, for grouped and plain heads, with and
without RoPE, in one program per row and KV head or split over the positions (merged by the second kernel), for
rows at position 0, at a chunk's edges and at the cache's end. Which steps take the kernel is tested here too;
the GPU's agreement inside the compiled decode step is tests/gpu/test_decode_attention_gpu.py's business."""

from __future__ import annotations

import pytest
import torch

from mmtrain.model.kv_cache import StaticKVCache, one_token_kernel_applies
from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.unit

CHILD = r"""
import torch

from tests.triton_interpreter import enable

enable()  # the interpreter's gaps: a scalar loop bound, bf16 dots

from mmtrain.model import decode_attention
from mmtrain.model.kv_cache import cached_attention
from mmtrain.model.layers import rope_cos_sin


def rope(x, cos, sin):  # fp32 math, one rounding: as the kernel (and Inductor's fused kernel) rounds
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)


g = torch.Generator().manual_seed(0)
cases = [  # B, H, KVH, D, T, positions, RoPE, positions per program, block_t
    (3, 8, 2, 32, 40, [0, 17, 39], True, 48, 16),
    (3, 8, 2, 32, 40, [15, 16, 33], True, 16, 16),
    (2, 4, 4, 64, 48, [5, 47], False, 48, 16),
    (2, 6, 2, 64, 64, [0, 31], True, 32, 16),
    (1, 16, 1, 32, 70, [69], True, 32, 32),
]
for B, H, KVH, D, T, positions, with_rope, chunk, block_t in cases:
    qkv = torch.randn(B, 1, (H + 2 * KVH) * D, generator=g).bfloat16()
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split((H * D, KVH * D, KVH * D), dim=-1))  # strided views
    pos = torch.tensor(positions)[:, None]
    cos, sin = rope_cos_sin(pos, 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), torch.bfloat16)
    k_cache = torch.randn(B, KVH, T, D, generator=g).bfloat16()
    v_cache = torch.randn(B, KVH, T, D, generator=g).bfloat16()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = (rope(q, cos, sin), rope(k, cos, sin)) if with_rope else (q, k)
    rows = torch.arange(B)
    ref_k[rows, :, pos[:, 0]] = k_ref[:, 0]
    ref_v[rows, :, pos[:, 0]] = v[:, 0]
    ref = cached_attention(q_ref.float(), ref_k.float(), ref_v.float(), torch.arange(T), pos)
    out = decode_attention.launch(q, k, v, cos if with_rope else None, sin if with_rope else None, k_cache,
                                  v_cache, pos, chunk, block_t=block_t)
    case = (B, H, KVH, D, T, positions, with_rope, chunk)
    assert torch.equal(k_cache, ref_k), ("keys", case, (k_cache.float() - ref_k.float()).abs().max())
    assert torch.equal(v_cache, ref_v), ("values", case)
    assert out.shape == (B, 1, H, D) and out.dtype == torch.bfloat16
    # the probabilities meet V in bf16, the output is rounded once: a few bf16 ulps of values ~1
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2, msg=lambda m: f"{case}: {m}")
# a position past the cache (the engine never decodes one): nothing written, the cache and the new key attended
B, H, KVH, D, T = 1, 4, 2, 32, 40
q, k, v = (torch.randn(1, 1, n, D, generator=g).bfloat16() for n in (H, KVH, KVH))
caches = [torch.randn(1, KVH, T, D, generator=g).bfloat16() for _ in range(2)]
before = [c.clone() for c in caches]
out = decode_attention.launch(q, k, v, None, None, caches[0], caches[1], torch.tensor([[T]]), 16, block_t=16)
assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
ref = cached_attention(q.float(), torch.cat((before[0], k.transpose(1, 2)), 2).float(),
                       torch.cat((before[1], v.transpose(1, 2)), 2).float(), torch.arange(T + 1), torch.tensor([[T]]))
torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)
if hasattr(decode_attention, "decode_attention"):  # the registered op picks its split itself
    B, H, KVH, D, T = 1, 4, 1, 32, 600  # split in 5 by chunk_for
    q, k, v = (torch.randn(1, 1, n, D, generator=g).bfloat16() for n in (H, KVH, KVH))
    caches = [torch.randn(1, KVH, T, D, generator=g).bfloat16() for _ in range(2)]
    pos = torch.tensor([[599]])
    out = decode_attention.decode_attention(q, k, v, None, None, caches[0], caches[1], pos)
    ref = cached_attention(q.float(), caches[0].float(), caches[1].float(), torch.arange(T), pos)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)
print("ok")
"""


def test_kernel_writes_the_cache_and_attends_as_the_reference_under_the_interpreter():
    run_interpreted(CHILD)


def test_chunks_give_enough_programs_and_are_never_tiny():
    pytest.importorskip("triton", reason="the decode attention kernel is written in Triton")
    from mmtrain.model import decode_attention as da

    assert da.chunk_for(1, 8, 392) == 128  # 4 programs per KV head (the H200's best at this shape)
    assert da.chunk_for(1, 8, 4096) == 128 and da.chunk_for(1, 8, 65536) == 2048  # ~264 programs
    assert da.chunk_for(4, 8, 392) == 128 and da.chunk_for(4, 8, 8192) == 1024
    assert da.chunk_for(32, 8, 4096) == 4096 and da.chunk_for(32, 8, 392) == 512  # 256 programs already
    assert da.chunk_for(1, 1, 600, block_t=64) == 128
    assert da.block_for(64) == da.block_for(128) == 128 and da.block_for(256) == 64
    assert da.supported(64, 32, 8, torch.bfloat16) and da.supported(128, 8, 8, torch.float16)
    assert not da.supported(16, 32, 8, torch.bfloat16) and not da.supported(96, 32, 8, torch.bfloat16)
    assert not da.supported(64, 12, 8, torch.bfloat16) and not da.supported(64, 32, 8, torch.float32)


def test_only_a_gpu_decode_step_of_every_slot_takes_the_kernel():
    cache = StaticKVCache(2, 3, 2, 16, 64, torch.bfloat16, "cpu")
    q = torch.zeros(3, 1, 4, 64, dtype=torch.bfloat16)
    assert not one_token_kernel_applies(q, cache, None, None, None)  # on the CPU: the SDPA path
    if not torch.cuda.is_available():
        return
    cache = StaticKVCache(2, 3, 2, 16, 64, torch.bfloat16, "cuda")
    q = q.cuda()
    assert one_token_kernel_applies(q, cache, None, None, None)
    assert not one_token_kernel_applies(q, cache, torch.arange(3, device="cuda"), None, None)  # a prefill's rows
    assert not one_token_kernel_applies(q, cache, None, 8, None)
    assert not one_token_kernel_applies(q, cache, None, None, 4)  # a sliding window keeps the mask
    assert not one_token_kernel_applies(torch.zeros(3, 2, 4, 64, dtype=torch.bfloat16, device="cuda"), cache,
                                        None, None, None)  # two new tokens per row
    assert not one_token_kernel_applies(q.float(), cache, None, None, None)
