"""The decode step's one-kernel attention on the GPU (``mmtrain.model.decode_attention``): a Llama attention
layer's ``forward_cached`` takes it for a decode step of every slot, and it equals the unfused step (RoPE, the
cache write, the masked ``cached_attention``) within bf16 rounding over many steps of rows at different positions,
split over positions or not; under torch.compile it writes the very cache tensors (no copy); a compiled engine
generates what the eager one does."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.model import decode_attention
from mmtrain.model.kv_cache import StaticKVCache, cached_attention, one_token_kernel_applies
from mmtrain.model.layers import Attention, apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def unfused(attn: Attention, x, cos, sin, cache: StaticKVCache, layer: int, positions):
    """The attention core of ``Attention.forward_cached`` without the kernel (the path every other call takes)."""
    q, k, v = attn.project(x, None, None)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(layer, None, positions, k, v)
    keys, values = cache.read(layer, None)
    out = cached_attention(q, keys, values, cache.key_index, positions)
    return attn.proj(out.reshape(q.shape[0], 1, -1))


@pytest.mark.parametrize("slots,max_len", [(1, 392), (4, 1100), (32, 300)])
def test_the_kernel_equals_the_unfused_step_over_many_steps(slots, max_len):
    torch.manual_seed(slots)
    cfg = ModelConfig(num_layers=1, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                      num_query_groups=2, vocab_size=64)
    attn = Attention(cfg).cuda().bfloat16()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    caches = [StaticKVCache(1, slots, 2, max_len, 64, torch.bfloat16, "cuda") for _ in range(2)]
    start = torch.randint(0, max_len // 2, (slots, 1), device="cuda")
    assert one_token_kernel_applies(torch.zeros(slots, 1, 8, 64, device="cuda", dtype=torch.bfloat16),
                                    caches[0], None, None, None)
    for step in range(max_len // 2 - 1):
        positions = start + step
        x = torch.randn(slots, 1, 512, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope_cos_sin(positions, inv_freq, torch.bfloat16)
        with torch.no_grad():
            got = attn.forward_cached(x, cos, sin, caches[0], 0, None, positions, None)
            want = unfused(attn, x, cos, sin, caches[1], 0, positions)
        if step % 37 == 0 or step == max_len // 2 - 2:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            # RoPE rounded once (the kernel, as Inductor's fused kernel) or after each of the eager path's three
            # ops, whose roundings a difference of nearly equal products does not shrink: a few ulps of keys ~1-4
            torch.testing.assert_close(caches[0].k[0].float(), caches[1].k[0].float(), rtol=2 ** -6, atol=5e-2)
            assert torch.equal(caches[0].v[0], caches[1].v[0])


def test_a_compiled_call_writes_the_cache_in_place_and_splits_merge():
    torch.manual_seed(0)
    B, H, KVH, D, T = 2, 32, 8, 64, 4096
    q, k, v = (torch.randn(B, 1, n, D, device="cuda", dtype=torch.bfloat16) for n in (H, KVH, KVH))
    caches = [torch.randn(B, KVH, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    pointers = [c.data_ptr() for c in caches]
    positions = torch.tensor([[3000], [17]], device="cuda")
    assert decode_attention.chunk_for(B, KVH, T) < T  # split, merged by the second kernel
    compiled = torch.compile(decode_attention.decode_attention, dynamic=False, fullgraph=True)
    before = [c.clone() for c in caches]
    out = compiled(q, k, v, None, None, caches[0], caches[1], positions)
    assert [c.data_ptr() for c in caches] == pointers
    rows = torch.arange(B, device="cuda")
    before[0][rows, :, positions[:, 0]] = k[:, 0]
    before[1][rows, :, positions[:, 0]] = v[:, 0]
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    want = cached_attention(q.float(), before[0].float(), before[1].float(), torch.arange(T, device="cuda"),
                            positions)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    for chunk in (T, 1408):  # one program per row and KV head, and an uneven split, at the same inputs
        again = decode_attention.launch(q, k, v, None, None, caches[0], caches[1], positions, chunk)
        torch.testing.assert_close(again.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("D,H,KVH", [(128, 32, 8), (256, 8, 4), (64, 8, 8)])
def test_other_head_layouts_fit_and_attend(D, H, KVH):
    torch.manual_seed(D)
    B, T = 3, 700
    q, k, v = (torch.randn(B, 1, n, D, device="cuda", dtype=torch.bfloat16) for n in (H, KVH, KVH))
    caches = [torch.randn(B, KVH, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    positions = torch.tensor([[0], [350], [699]], device="cuda")
    out = decode_attention.decode_attention(q, k, v, None, None, caches[0], caches[1], positions)
    want = cached_attention(q.float(), caches[0].float(), caches[1].float(), torch.arange(T, device="cuda"),
                            positions)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
