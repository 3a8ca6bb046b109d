"""``train.document_attention=flex_flash`` on the GPU (skipped without CUDA, a Hopper or later GPU, or
flash-attn-4): FlexAttention's FLASH backend (flash-attn-4's CuTe kernels) with mmtrain's block masks equals the
fp32 dense-mask reference within bf16's rounding (outputs and q/k/v gradients: documents, a sliding window, a
context-parallel query offset, grouped heads, head dims 64 and 128), as closely as flex's Triton kernel does; and
a compiled packed GPT trains with it as with the Triton kernel."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.model.attention import CausalAttention, DenseDocuments, FlexDocuments
from mmtrain.models.llama.model import GPTModel
from mmtrain.utils.optional import flash_available

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9 or not flash_available(),
    reason="needs a Hopper or later CUDA GPU and flash-attn-4 (pip install 'mmtrain[flash]')")
DEV = torch.device("cuda")


def _ids(B: int, S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        bounds = torch.cumsum(torch.randint(1, 700, (S,), generator=g), 0)
        for x in bounds[bounds < S].tolist():
            ids[b, x:] += 1
    return ids


def _run(kernel, q, k, v, q_ids, kv_ids, q_offset, window, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = kernel.attend(q, k, v, kernel.mask(q_ids, kv_ids, q_offset, window), None)
    out.backward(grad)
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("S, q_offset, window, D", [(1024, 0, None, 64), (4096, 0, None, 64), (2048, 1024, None, 64),
                                                    (2048, 0, 512, 64), (1024, 0, None, 128)])
def test_flash_backend_equals_the_dense_reference(S, q_offset, window, D):
    ids = _ids(2, S, S + D).to(DEV)
    q_ids, kv_ids = ids[:, q_offset:], ids
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(2, 8, S - q_offset, D, device=DEV, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, S, D, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    ref = _run(DenseDocuments(), q.float(), k.float(), v.float(), q_ids, kv_ids, q_offset, window, grad.float())
    flash = _run(FlexDocuments(backend="FLASH"), q, k, v, q_ids, kv_ids, q_offset, window, grad)
    triton = _run(FlexDocuments(), q, k, v, q_ids, kv_ids, q_offset, window, grad)
    for name, want, got, other in zip(("out", "dq", "dk", "dv"), ref, flash, triton):
        scale = want.abs().max().item()
        flash_err, triton_err = ((got - want).abs().max().item() / scale, (other - want).abs().max().item() / scale)
        # bf16 inputs and outputs: a few ulps of the largest value; no worse than twice the Triton kernel's error
        assert flash_err < max(2e-2, 2 * triton_err), (name, flash_err, triton_err)


def test_compiled_packed_gpt_trains_with_the_flash_backend():
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=256", "model.hidden_size=256",
                                           "model.ffn_hidden_size=512", "model.num_layers=2",
                                           "model.num_attention_heads=4", "model.num_query_groups=2"]).model
    models = [GPTModel(cfg, attention=CausalAttention(kind)).to(DEV, torch.bfloat16) for kind in ("flex_flash", "flex")]
    for m in models:
        m.init_weights(0)
        for block in m.layers.values():
            block.compile()
    for step in range(3):
        tokens = torch.randint(1, 256, (2, 1025), generator=torch.Generator().manual_seed(step)).to(DEV)
        tokens[tokens < 4] = 0  # an EOD about every 64 tokens, at other places each step
        positions, doc_ids, _ = packed_document_inputs(tokens, 0, True, True, False)
        losses = []
        for m in models:
            for p in m.parameters():
                p.grad = None
            loss = m(tokens[:, :-1], tokens[:, 1:], positions, doc_ids).float().mean()
            loss.backward()
            losses.append(loss.item())
            assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[1]), (step, losses)
