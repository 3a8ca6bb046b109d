"""A prefill from position 0 on the GPU (``kv_cache.from_start_attention``): flash attention, which needs no
per-shape plan, with grouped-query heads unexpanded, equal to the masked attention within bf16 rounding, at
Llama-3.2-1B's head layout and prompt lengths no earlier call had."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mmtrain.model.kv_cache import cached_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("B,S", [(1, 128), (32, 97), (3, 300)])
def test_a_prefill_runs_flash_and_equals_the_masked_attention(B, S):
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + S)
    q = torch.randn(B, S, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    keys, values = torch.randn(2, B, 8, S, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.arange(S, device="cuda").expand(B, S)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = cached_attention(q, keys, values, torch.arange(S, device="cuda"), positions)
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()]
    assert any("flash" in n for n in names), f"no flash kernel among {sorted(set(names))[:20]}"
    assert not any("cudnn" in n for n in names)
    visible = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
    want = F.scaled_dot_product_attention(q.transpose(1, 2).float(), keys.float(), values.float(),
                                          attn_mask=visible, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
