"""The Gemma 3 text family (mmtrain/models/gemma3): logits parity with random tiny HF Gemma3ForCausalLM models on
sequences longer than the sliding window, exact state-dict and config round trips, each quirk visible in the
logits, packed documents inside windows, config and adapter refusals, the sharding spec's coverage."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma3ForCausalLM"):
    pytest.skip("this transformers has no Gemma3ForCausalLM", allow_module_level=True)

from mmtrain.config.loader import ConfigError  # noqa: E402
from mmtrain.model.attention import CausalAttention  # noqa: E402
from mmtrain.models.gemma3.config import GLOBAL, LOCAL, Gemma3Config  # noqa: E402
from mmtrain.models.gemma3.flops import count_parameters, flops_per_token, mean_keys  # noqa: E402
from mmtrain.models.gemma3.hf_adapter import (HFAdapterError, config_from_hf, config_to_hf,  # noqa: E402
                                              state_dict_from_hf, state_dict_to_hf)
from mmtrain.models.gemma3.model import Gemma3Model  # noqa: E402

pytestmark = pytest.mark.unit

L, G = LOCAL, GLOBAL
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=12, sliding_window=5, query_pre_attn_scalar=10,
             max_position_embeddings=128)
CASES = {
    # the per-layer-type rope_parameters transformers 5 writes; linear scaling on the global layers; capped logits
    "types_tied_linear_softcap": dict(layer_types=[L, G, L, L], final_logit_softcapping=8.0, rope_parameters={
        L: {"rope_type": "default", "rope_theta": 100.0},
        G: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}}),
    # the older keys of the Hub's Gemma 3 configs: a pattern, rope_theta / rope_local_base_freq; one KV head
    "pattern_untied_mqa": dict(sliding_window_pattern=3, rope_theta=10_000.0, rope_local_base_freq=50.0,
                               num_key_value_heads=1, sliding_window=6, tie_word_embeddings=False),
}
SEQ = 30  # longer than every window above: a model ignoring the window differs


def _local_layers(cfg: Gemma3Config) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_kinds()) if kind == LOCAL]


@functools.cache
def _random_hf(case: str = "types_tied_linear_softcap"):
    """A tiny random HF model with non-trivial norms and scaled-up weights (sharp attention, so that windows and
    RoPE bases show in the logits). Cached: callers only read it."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**SMALL, **CASES[case]}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0 if "self_attn" in name else 20.0 if "embed" in name or "lm_head" in name else 2.0)
    return model.eval()


def _ids(batch: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _ours(cfg: Gemma3Config, state: dict) -> Gemma3Model:
    model = Gemma3Model(cfg, attention=CausalAttention(documents="dense"))
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_and_round_trips_are_exact(case, tmp_path):
    from safetensors.torch import load_file

    hf_model = _random_hf(case)
    hf_model.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert _local_layers(cfg) and len(_local_layers(cfg)) < cfg.num_layers and SEQ > cfg.sliding_window
    ours = _ours(cfg, state_dict_from_hf(files, cfg))
    ids = _ids()
    with torch.no_grad():
        theirs = hf_model(ids).logits
        mine = ours(ids)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (mine - theirs).abs().max().item() < 1e-4

    state = ours.state_dict()
    back = state_dict_to_hf(state, cfg)
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)
    module_state = hf_model.state_dict()  # in memory a tied model lists lm_head too
    assert all(torch.equal(v, state[k]) for k, v in state_dict_from_hf(module_state, cfg).items())

    # the config.json written from ours builds the same HF model (and reads back to the same config)
    again = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config_to_hf(cfg))).eval()
    again.load_state_dict(back, strict=not cfg.tie_word_embeddings)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs)
    assert config_from_hf(config_to_hf(cfg)) == cfg

    ours.train()
    loss = ours(ids, ids.roll(-1, dims=1)).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.parametrize("change", [
    dict(sliding_window=10**6), dict(layer_types=[G] * 4), "local_rope_is_global", dict(query_pre_attn_scalar=12.0),
    dict(final_logit_softcapping=None), dict(rope_scaling="none", rope_scaling_factor=1.0), "embedding_unscaled",
    "norms_without_offset",
], ids=str)
def test_each_quirk_shows_in_the_logits(change):
    """The parity test would notice each detail being wrong: changing it on our side alone moves the logits
    (a model that ignores the window, one RoPE base for all layers, 1/sqrt(head_dim), no soft-cap, ...)."""
    hf_model = _random_hf()
    cfg = config_from_hf(hf_model.config.to_dict())
    state = state_dict_from_hf(hf_model.state_dict(), cfg)
    ids = _ids()
    with torch.no_grad():
        base = _ours(cfg, state)(ids)
        model = None
        if change == "local_rope_is_global":
            model = _ours(dataclasses.replace(cfg, rope_local_base_freq=cfg.rope_theta), state)
        elif change == "embedding_unscaled":
            model = _ours(cfg, state)
            model.embed_scale.fill_(1.0)
        elif change == "norms_without_offset":
            model = _ours(cfg, {k: v - 1 if k.endswith("norm.weight") else v for k, v in state.items()})
        else:
            model = _ours(dataclasses.replace(cfg, **change), state)
        assert (model(ids) - base).abs().max() > 1e-3


def test_attention_soft_capping_is_applied_when_set():
    """attn_logit_softcapping (refused from HF configs: transformers' Gemma 3 ignores it) caps our scores."""
    cfg = dataclasses.replace(Gemma3Config(), init_std=0.5)
    model = Gemma3Model(cfg, attention=CausalAttention(documents="dense"))
    model.init_weights(0)
    capped = Gemma3Model(dataclasses.replace(cfg, attn_logit_softcapping=0.5),
                         attention=CausalAttention(documents="dense"))
    capped.load_state_dict(model.state_dict())
    ids = _ids(1, 20)
    with torch.no_grad():
        assert (capped.eval()(ids) - model.eval()(ids)).abs().max() > 1e-3


def test_packed_documents_attend_inside_their_document_and_window():
    """Window ∩ document: each packed document (longer than the window) computes what it computes alone."""
    hf_model = _random_hf()
    cfg = config_from_hf(hf_model.config.to_dict())
    model = _ours(cfg, state_dict_from_hf(hf_model.state_dict(), cfg))
    ids = _ids(1, 21, seed=2)
    doc_ids = torch.tensor([[0] * 9 + [1] * 12])
    positions = torch.tensor([list(range(9)) + list(range(12))])
    with torch.no_grad():
        packed = model(ids, position_ids_BS=positions, doc_ids_BS=doc_ids)
        first, second = model(ids[:, :9]), model(ids[:, 9:])
        assert (packed[:, :9] - first).abs().max() < 1e-5 and (packed[:, 9:] - second).abs().max() < 1e-5
        assert (packed[:, 9:] - model(ids)[:, 9:]).abs().max() > 1e-3  # the documents do differ from one sequence


def test_config_checks_name_the_field():
    for change, field in [(dict(num_key_value_heads=3), "num_key_value_heads"), (dict(head_dim=7), "head_dim"),
                          (dict(layer_types=[L, G]), "layer_types"), (dict(layer_types=[L, G, "chunked", G]),
                                                                      "layer_types"),
                          (dict(rope_scaling_factor=2.0), "rope_scaling_factor"),
                          (dict(final_logit_softcapping=-1.0), "final_logit_softcapping")]:
        with pytest.raises(ConfigError, match=rf"^model\.gemma3\.{field}="):
            dataclasses.replace(Gemma3Config(), **change).check(prefix="model.gemma3.")
    assert Gemma3Config(num_layers=6, sliding_window_pattern=3).layer_kinds() == (L, L, G, L, L, G)


def test_hf_adapter_refuses_what_it_cannot_map():
    hf_model = _random_hf()
    hf = hf_model.config.to_dict()
    cfg = config_from_hf(hf)
    for key, value, match in [
        ("model_type", "gemma3", "model_type='gemma3'"), ("hidden_activation", "gelu", "hidden_activation"),
        ("attention_bias", True, "attention_bias"), ("use_bidirectional_attention", True, "use_bidirectional"),
        ("attn_logit_softcapping", 50.0, "does not apply it"), ("sliding_window", None, "lacks 'sliding_window'"),
        ("head_dim", -4, r"head_dim=-4 must be an integer >= 1"), ("layer_types", [L, "other", L, G], "layer_types"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 10.0}, "per-layer-type"),
        ("rope_parameters", {G: {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10.0}}, "'yarn'"),
    ]:
        with pytest.raises(HFAdapterError, match=match):
            config_from_hf({**hf, key: value})
    with pytest.raises(HFAdapterError, match="train without it"):
        config_to_hf(dataclasses.replace(cfg, attn_logit_softcapping=30.0))

    tensors = dict(hf_model.state_dict())
    with pytest.raises(HFAdapterError, match=r"lacks 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        state_dict_from_hf({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_norm.weight"}, cfg)
    with pytest.raises(HFAdapterError, match=r"has 'model\.layers\.0\.extra\.weight'"):
        state_dict_from_hf({**tensors, "model.layers.0.extra.weight": torch.zeros(2)}, cfg)
    wrong = {**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(36, 32)}
    with pytest.raises(HFAdapterError, match=r"num_key_value_heads=2 \(x head_dim 12 = 24\), but the weights hold 3"):
        state_dict_from_hf(wrong, cfg)
    untied = {**tensors, "lm_head.weight": torch.zeros_like(tensors["lm_head.weight"])}
    with pytest.raises(HFAdapterError, match="tie_word_embeddings"):
        state_dict_from_hf(untied, cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_sharding_spec_covers_every_tensor_and_counts_add_up(tied):
    cfg = Gemma3Config(tie_word_embeddings=tied)
    model = Gemma3Model(cfg)
    spec = model.sharding_spec()
    params = dict(model.named_parameters())
    assert set(model.state_dict()) | {"output.weight"} == set(spec)
    for name, p in params.items():
        entry = spec[name]
        if entry.parts:
            assert sum(entry.parts) == p.shape[entry.dim], name
        if entry.unit > 1:
            assert p.shape[entry.dim] % entry.unit == 0, name
    assert spec["layers.0.attn.q_norm.weight"].tp_partial_grad == "always"
    assert spec["output.weight"].tied_to == ("embed.weight" if tied else None)
    assert count_parameters(cfg) == sum(p.numel() for p in params.values())
    S, W = 64, cfg.sliding_window
    local = len(_local_layers(cfg))
    attention = 12 * cfg.num_attention_heads * cfg.head_dim * (local * (W - W * W / (2 * S)) + (cfg.num_layers - local)
                                                                * S / 2)
    embedding = cfg.vocab_size * cfg.hidden_size * (0 if tied else 1)  # the lookup costs no FLOPs
    assert flops_per_token(cfg, S) == pytest.approx(6 * (count_parameters(cfg) - embedding) + attention)
    assert mean_keys(8, 8) == mean_keys(8, None) == 4


def test_family_package_lists_documented_public_names():
    import mmtrain.models.gemma3 as family

    for name in family.__all__:
        assert (getattr(family, name).__doc__ or "").strip(), name
