"""The DeepSeek-V3 family (mmtrain/models/deepseek_v3): logits parity with random tiny HF DeepseekV3ForCausalLM
models, exact state-dict round trips, config checks, the sharding spec's coverage, a training smoke test."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from mmtrain.config.loader import ConfigError  # noqa: E402
from mmtrain.models.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from mmtrain.models.deepseek_v3.shape_file import load_deepseek_v3_config  # noqa: E402
from mmtrain.models.deepseek_v3.flops import count_parameters, flops_per_token  # noqa: E402
from mmtrain.models.deepseek_v3.hf_adapter import (HFAdapterError, config_from_hf, config_to_hf,  # noqa: E402
                                                   state_dict_from_hf, state_dict_to_hf)
from mmtrain.models.deepseek_v3.model import DeepseekV3Model  # noqa: E402
from mmtrain.models.deepseek_v3.spec import sharding_of, size_of  # noqa: E402

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "configs" / "models" / "deepseek-v3-tiny.yaml"

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
             n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707}
CASES = {
    "q_lora_groups_untied": dict(),
    "no_q_lora_unnormalized_tied_two_shared": dict(q_lora_rank=None, norm_topk_prob=False, tie_word_embeddings=True,
                                                   n_shared_experts=2),
    "yarn_rope": dict(rope_parameters=YARN),
    "rotate_half_one_group_two_dense": dict(rope_interleave=False, n_group=1, topk_group=1, first_k_dense_replace=2),
}


@functools.cache
def _random_hf(case: str = "q_lora_groups_untied"):
    """A tiny random HF model with non-trivial norms and routing biases and weights scaled up (sharp attention
    and decisive routing, so that layout and routing details show in the logits). Cached: callers only read it."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SMALL, **CASES[case]}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.mul_(12.0 if "self_attn" in name else 4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=g)
    return ids, (torch.arange(20) + 40).expand(2, 20)


def _ours(cfg, state):
    model = DeepseekV3Model(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_and_round_trip_is_exact(case, tmp_path):
    from safetensors.torch import load_file

    hf_model = _random_hf(case)
    hf_model.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")  # one tensor per expert, as on the Hub
    cfg = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    ours = _ours(cfg, state_dict_from_hf(files, cfg))
    ids, positions = _inputs()
    with torch.no_grad():
        theirs = hf_model(ids, position_ids=positions).logits
        mine = ours(ids, position_ids_BS=positions)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (mine - theirs).abs().max().item() < 1e-4

    # HF -> ours -> HF is exact, in both expert layouts
    state = ours.state_dict()
    back = state_dict_to_hf(state, cfg)
    if cfg.tie_word_embeddings:
        files.pop("lm_head.weight", None)
    assert sorted(back) == sorted(files)
    assert all(torch.equal(back[k], files[k]) for k in files)
    module_state = hf_model.state_dict()
    back = state_dict_to_hf(state, cfg, experts_layout="module")
    if cfg.tie_word_embeddings:
        module_state.pop("lm_head.weight")
    assert sorted(back) == sorted(module_state)
    assert all(torch.equal(back[k], module_state[k]) for k in module_state)
    assert all(torch.equal(v, state[k]) for k, v in state_dict_from_hf(module_state, cfg).items())

    # config.json written from ours builds the same HF model: load our tensors into it, same logits
    again = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config_to_hf(cfg))).eval()
    again.load_state_dict(state_dict_to_hf(state, cfg, experts_layout="module"), strict=not cfg.tie_word_embeddings)
    with torch.no_grad():
        assert torch.equal(again(ids, position_ids=positions).logits, theirs)
    assert config_from_hf(config_to_hf(cfg)) == cfg

    ours.train()
    loss = ours(ids, ids.roll(-1, dims=1), position_ids_BS=positions).mean()
    loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.2.mlp.router.weight"].abs().sum() > 0  # gradients reach the router through the weights


@pytest.mark.parametrize("change", [
    dict(rope_interleave=False), dict(topk_group=4), dict(norm_topk_prob=False), dict(routed_scaling_factor=1.0),
    dict(yarn=True), "zero_bias",
])
def test_each_quirk_shows_in_the_logits(change):
    """The parity test would notice each detail being wrong: changing it on our side alone moves the logits."""
    hf_model = _random_hf()
    cfg = config_from_hf(hf_model.config.to_dict())
    state = state_dict_from_hf(hf_model.state_dict(), cfg)
    ids, positions = _inputs()
    with torch.no_grad():
        base = _ours(cfg, state)(ids, position_ids_BS=positions)
        if change == "zero_bias":
            state = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
        elif "yarn" in change:
            cfg = dataclasses.replace(cfg, rope_scaling="yarn", yarn_factor=4.0,
                                      yarn_original_max_position_embeddings=64)
        else:
            cfg = dataclasses.replace(cfg, **change)
        assert (_ours(cfg, state)(ids, position_ids_BS=positions) - base).abs().max() > 1e-3


def test_packed_documents_attend_only_inside_their_document():
    cfg = load_deepseek_v3_config(TINY_YAML)
    model = DeepseekV3Model(cfg).eval()
    model.init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    with torch.no_grad():
        packed = model(ids, position_ids_BS=positions, doc_ids_BS=doc_ids)
        alone = model(ids[:, 5:])
    assert (packed[:, 5:] - alone).abs().max() < 1e-5


def test_training_smoke_loss_decreases_and_biases_balance():
    cfg = load_deepseek_v3_config(TINY_YAML, ["model.vocab_size=64"])
    torch.manual_seed(0)
    model = DeepseekV3Model(cfg)
    model.init_weights(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(8):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loads = model.update_routing_biases()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert sorted(loads) == ["layers.1.mlp", "layers.2.mlp"]
    assert all(sum(v) == 4 * 32 * cfg.num_experts_per_tok for v in loads.values())
    bias = model.layers["1"].mlp.router.expert_bias
    assert bias.abs().max() > 0 and model.layers["1"].mlp.step_load is None


def test_shipped_yaml_loads_and_bad_values_name_the_field(tmp_path):
    cfg = load_deepseek_v3_config(TINY_YAML)
    assert cfg.q_lora_rank == 32 and cfg.n_group == 4 and cfg.v_head_dim != cfg.qk_head_dim
    for override, field in [("model.n_group=3", "model.n_group"),
                            ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim"),
                            ("model.topk_group=5", "model.topk_group"), ("model.q_lora_rank=0", "model.q_lora_rank"),
                            ("model.num_experts_per_tok=9", "model.num_experts_per_tok")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_deepseek_v3_config(TINY_YAML, [override])
    assert load_deepseek_v3_config(TINY_YAML, ["model.q_lora_rank=null"]).q_lora_rank is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_groups: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.n_groups'.*did you mean 'model\.n_group'"):
        load_deepseek_v3_config(bad)


def test_hf_adapter_refuses_what_it_cannot_map():
    hf_model = _random_hf()
    hf = hf_model.config.to_dict()
    cfg = config_from_hf(hf)
    for key, value, match in [("hidden_act", "gelu", "hidden_act"), ("num_key_value_heads", 2, "num_key_value_heads"),
                              ("attention_bias", True, "attention_bias"), ("n_group", None, "n_group"),
                              ("model_type", "llama", "model_type")]:
        with pytest.raises(HFAdapterError, match=match):
            config_from_hf({**hf, key: value})
    with pytest.raises(HFAdapterError, match="lacks 'kv_lora_rank'"):
        config_from_hf({k: v for k, v in hf.items() if k != "kv_lora_rank"})
    with pytest.raises(HFAdapterError, match="n_group"):
        config_from_hf({**hf, "n_group": 3})

    tensors = dict(hf_model.state_dict())
    with pytest.raises(HFAdapterError, match=r"lacks 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias'"):
        state_dict_from_hf({k: v for k, v in tensors.items() if "e_score" not in k}, cfg)
    mtp = {**tensors, "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(HFAdapterError, match="multi-token-prediction.*drop_mtp_layers=True"):
        state_dict_from_hf(mtp, cfg)
    assert sorted(state_dict_from_hf(mtp, cfg, drop_mtp_layers=True)) == sorted(state_dict_from_hf(tensors, cfg))
    wrong = {**tensors, "model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(8, 16)}
    with pytest.raises(HFAdapterError, match=r"num_attention_heads=4 .*kv_b_proj\.weight has shape \(8, 16\)"):
        state_dict_from_hf(wrong, cfg)


@pytest.mark.parametrize("q_lora_rank,tied", [(32, False), (None, True)])
def test_sharding_spec_covers_every_tensor_and_counts_add_up(q_lora_rank, tied):
    cfg = dataclasses.replace(load_deepseek_v3_config(TINY_YAML), q_lora_rank=q_lora_rank, tie_word_embeddings=tied)
    model = DeepseekV3Model(cfg)
    params = dict(model.named_parameters())
    for name, t in model.state_dict().items():
        rule = sharding_of(name)
        assert rule.buffer == (name not in params), name
        if rule.parts:
            assert sum(size_of(p, cfg) for p in rule.parts) == t.shape[rule.dim], name
        if rule.unit:
            assert t.shape[rule.dim] == cfg.num_attention_heads * size_of(rule.unit, cfg), name
        if rule.expert_dim is not None:
            assert t.shape[rule.expert_dim] == cfg.n_routed_experts, name
    with pytest.raises(KeyError, match="0 sharding rules"):
        sharding_of("layers.0.attn.qkv.weight")
    assert count_parameters(cfg) == sum(p.numel() for p in params.values())
    active = count_parameters(cfg, active=True)
    unused = (cfg.n_routed_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert active == count_parameters(cfg) - 2 * unused  # two MoE layers
    output_not_embedding = 0 if tied else cfg.vocab_size * cfg.hidden_size  # the lookup costs no FLOPs
    attention = 3 * cfg.num_layers * 128 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, 128) == 6 * (active - output_not_embedding) + attention


def test_family_package_lists_documented_public_names():
    import mmtrain.models.deepseek_v3 as family

    for name in family.__all__:
        obj = getattr(family, name)
        assert isinstance(obj, tuple) or (obj.__doc__ or "").strip(), name
