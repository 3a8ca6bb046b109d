"""Single-device model behaviour: shapes, init determinism, document masking, RoPE scaling."""

from __future__ import annotations

import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.model.attention import document_causal_mask
from mmtrain.models.llama.model import GPTModel, count_parameters
from mmtrain.model.layers import rope_frequencies


def _cfg(*extra):
    return load_config(GPTRunConfig, None, ["data.mock=true", *extra]).model


def test_parameter_count_formula_matches_the_module():
    for extra in ([], ["model.tie_embeddings=true"], ["model.activation=gelu"]):
        cfg = _cfg(*extra)
        assert count_parameters(cfg) == sum(p.numel() for p in GPTModel(cfg).parameters())


def test_init_is_deterministic_and_split_independent():
    cfg = _cfg("model.num_layers=4")
    whole = GPTModel(cfg)
    whole.init_weights(7)
    tail = GPTModel(cfg, layer_range=(2, 4), pre_process=False)
    tail.init_weights(7)
    for name, p in tail.named_parameters():
        torch.testing.assert_close(p, dict(whole.named_parameters())[name], rtol=0, atol=0)


def test_document_mask_isolates_documents():
    cfg = _cfg()
    model = GPTModel(cfg)
    model.init_weights(0)
    torch.manual_seed(0)
    a = torch.randint(0, cfg.vocab_size, (1, 5))
    b = torch.randint(0, cfg.vocab_size, (1, 7))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed_logits = model(packed, position_ids_BS=positions, doc_ids_BS=doc_ids)
        alone_b = model(b)
        alone_a = model(a)
    torch.testing.assert_close(packed_logits[:, 5:], alone_b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed_logits[:, :5], alone_a, rtol=1e-4, atol=1e-5)
    mask = document_causal_mask(doc_ids)
    assert mask.shape == (1, 1, 12, 12) and not mask[0, 0, 5, 4] and mask[0, 0, 6, 5] and not mask[0, 0, 5, 6]


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = rope_frequencies(64, 500000.0)
    scaled = rope_frequencies(64, 500000.0, scaling_factor=32.0)
    assert torch.equal(plain[:4], scaled[:4])  # high frequencies (short wavelengths) untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 32.0)
