"""Document-masked attention on the GPU (skipped without CUDA): the fused FlexAttention kernel with the block masks
equals the dense-mask reference (fp32 without TF32: outputs and q/k/v gradients, also for a context-parallel
query offset); a compiled GPT with packed documents equals the dense model (loss, gradients) and takes new
document boundaries without recompiling."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.model.attention import CausalAttention, DenseDocuments, FlexDocuments, dense_document_mask
from mmtrain.models.llama.model import GPTModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _ids(S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 400, (S,), generator=g)
    bounds = torch.cumsum(lengths, 0)
    ids = torch.zeros(S, dtype=torch.long)
    for b in bounds[bounds < S].tolist():
        ids[b:] += 1
    return ids


@pytest.mark.parametrize("S, q_offset", [(1024, 0), (1024, 512), (4096, 0)])
def test_fused_flex_kernel_equals_dense(S, q_offset):
    """(4096: 32 blocks a side, the 1B bench row's; transposed block lists gave it 1e8-sized gradients.)"""
    Q = S - q_offset
    ids = torch.stack([_ids(S, 0), _ids(S, 1)]).to(DEV)
    q_ids, kv_ids = ids[:, q_offset:], ids
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(2, 8, Q, 64, device=DEV, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 64, device=DEV, generator=g, requires_grad=True) for _ in range(2))
    results = []
    for kernel in (FlexDocuments(), DenseDocuments()):
        out = kernel.attend(q, k, v, kernel.mask(q_ids, kv_ids, q_offset), None)
        out.square().sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in (q, k, v)]))
        for t in (q, k, v):
            t.grad = None
    (flex_out, flex_grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(flex_out, ref_out, rtol=1e-4, atol=1e-5)
    for got, want in zip(flex_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    assert dense_document_mask(q_ids, kv_ids, q_offset).shape == (2, 1, Q, S)


def test_compiled_packed_gpt_equals_dense_and_does_not_recompile():
    from torch._dynamo.utils import counters

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=256", "model.hidden_size=128",
                                           "model.ffn_hidden_size=256", "model.num_layers=2",
                                           "model.num_attention_heads=4", "model.num_query_groups=2"]).model
    flex = GPTModel(cfg, attention=CausalAttention("flex")).to(DEV)
    dense = GPTModel(cfg, attention=CausalAttention("dense")).to(DEV)
    for m in (flex, dense):
        m.init_weights(0)
    for block in flex.layers.values():
        block.compile()
    torch._dynamo.reset()
    counters.clear()
    for step in range(3):
        tokens = torch.randint(1, 256, (2, 513), generator=torch.Generator().manual_seed(step)).to(DEV)
        tokens[tokens < 8] = 0  # EOD about every 32 tokens, at other places each step
        positions, doc_ids, _ = packed_document_inputs(tokens, 0, True, True, False)
        losses = []
        for m in (flex, dense):
            for p in m.parameters():
                p.grad = None
            loss = m(tokens[:, :-1], tokens[:, 1:], positions, doc_ids).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
        ref = dict(dense.named_parameters())
        for name, p in flex.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=2e-3, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
        if step == 0:
            compiled = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == compiled  # later boundaries: no new graphs
