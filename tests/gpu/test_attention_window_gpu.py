"""Sliding windows, sinks and softcap on the GPU (skipped without CUDA): the fused (compiled) FlexAttention kernel
with window ∩ document block masks equals the dense reference, outputs and q/k/v/sink gradients (fp32 without
TF32), at the real 128-token tile with windows that are no multiple of it; a compiled Mistral-shaped GPT with
packed documents equals the dense model and takes new boundaries without recompiling."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.model.attention import CausalAttention, DenseDocuments, FlexDocuments
from mmtrain.models.llama.model import GPTModel
from tests.gpu.test_packed_attention_gpu import _ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("window, extra", [(1, {}), (200, {}), (333, {"softcap": 20.0}), (700, {"sinks": True}),
                                           (90, {"softcap": 5.0, "sinks": True})])
def test_fused_flex_window_sinks_softcap_equal_dense(window, extra):
    S = 1024
    ids = torch.stack([_ids(S, 2), _ids(S, 3)]).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(2, 8, S, 64, device=DEV, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 64, device=DEV, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.linspace(-1.0, 2.0, 8, device=DEV).requires_grad_()
    options = {"softcap": extra.get("softcap"), "sinks_H": sinks if extra.get("sinks") else None}
    results = []
    for kernel in (FlexDocuments(), DenseDocuments()):
        out = kernel.attend(q, k, v, kernel.mask(ids, ids, 0, window), None, **options)
        out.square().sum().backward()
        tensors = (q, k, v, sinks)
        results.append((out.detach(), [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in tensors]))
        for t in tensors:
            t.grad = None
    (flex_out, flex_grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(flex_out, ref_out, rtol=1e-4, atol=1e-5)
    for got, want in zip(flex_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_compiled_windowed_gpt_equals_dense_and_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=256", "model.hidden_size=128",
                                           "model.ffn_hidden_size=256", "model.num_layers=2",
                                           "model.num_attention_heads=4", "model.num_query_groups=2",
                                           "model.sliding_window=200"]).model
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    flex = GPTModel(cfg, attention=CausalAttention(FlexDocuments())).to(DEV)
    dense = GPTModel(cfg, attention=CausalAttention(DenseDocuments())).to(DEV)
    flex.init_weights(0)
    dense.load_state_dict(flex.state_dict())
    for block in flex.layers.values():
        block.compile(backend=counter, dynamic=False)
    frames = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(1, 256, (2, 1025), generator=g)
        tokens[torch.rand(2, 1025, generator=g) < 0.003 * (step + 1)] = 0
        positions, doc_ids, _ = packed_document_inputs(tokens, 0, True, True, True)
        tokens, positions, doc_ids = tokens.to(DEV), positions.to(DEV), doc_ids.to(DEV)
        losses = []
        for model in (flex, dense):
            model.zero_grad()
            loss = model(tokens[:, :-1], tokens[:, 1:], positions, doc_ids).mean()
            loss.backward()
            losses.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (got, got_grads), (want, want_grads) = losses
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-4)
        frames.append(counter.frame_count)
    assert frames == [frames[0]] * 3, frames
