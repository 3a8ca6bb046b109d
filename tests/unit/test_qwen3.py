"""Qwen3 and Qwen3-MoE in the Llama family: an explicit ``model.head_dim``, q/k RMSNorm (``qk_norm``), the
router's ``moe_norm_topk_prob`` and dense layers (``moe_dense_layers``) -- against transformers'
Qwen3ForCausalLM / Qwen3MoeForCausalLM (tiny random fp32 models): ``compare`` within 1e-4 after
``hf-to-mmtrain``, ``mmtrain-to-hf`` bit-exact, greedy KV-cache decoding equal to ``generate`` token for token;
the shape pieces (projections, RoPE, KV cache, spec, FLOPs, checks) and the bundled configs of real sizes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.config.schema import ModelConfig
from mmtrain.convert.__main__ import main as convert_main
from mmtrain.convert.checkpoint_io import read_full_state
from mmtrain.convert.hf_files import read_hf_tensors
from mmtrain.model.mlp import MLP
from mmtrain.model.moe import MoELayer, _Router
from mmtrain.models.llama.hf_adapter import UnsupportedHFConfig, model_config_from_hf
from mmtrain.models.llama.model import GPTModel, count_parameters, flops_per_token
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.models.registry import model_family

pytestmark = pytest.mark.unit

# 4 heads of 16 in a width of 32 (head_dim apart from hidden / heads, as in Qwen3-0.6B and Qwen3-30B-A3B)
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=96, max_position_embeddings=256, rope_theta=1e6, initializer_range=0.2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CASES = {
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    # layers 1 and 3 routed by decoder_sparse_step 2, layer 3 dense by mlp_only_layers: only layer 1 has experts
    "qwen3_moe_sparse_step_mlp_only_raw_topk": ("qwen3_moe", dict(**MOE, decoder_sparse_step=2, mlp_only_layers=[3],
                                                                   norm_topk_prob=False)),
    "qwen3_moe_all_routed_norm_topk": ("qwen3_moe", dict(**MOE, norm_topk_prob=True)),
    # windows shorter than the 40 test tokens (model.sliding_window): a model that ignored them would differ
    "qwen3_sliding_window_every_layer": ("qwen3", dict(use_sliding_window=True, sliding_window=6,
                                                        max_window_layers=0)),
    "qwen3_moe_sliding_window": ("qwen3_moe", dict(**MOE, norm_topk_prob=True, use_sliding_window=True,
                                                   sliding_window=7)),
}


def _random_hf(kind: str, path, **overrides):
    """A tiny random HF model saved to ``path``, norm weights (q/k norms too) made non-trivial."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SMALL, **overrides}))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SMALL, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


def _ours(ckpt, **change) -> tuple[GPTModel, ModelConfig]:
    full, cfg, _ = read_full_state(ckpt)
    cfg = dataclasses.replace(cfg, **change)
    model = GPTModel(cfg)
    model.load_state_dict(full, strict=True)
    return model.eval(), cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_compare_within_1e4_and_the_round_trip_is_exact(case, tmp_path, capsys):
    kind, overrides = CASES[case]
    hf = _random_hf(kind, tmp_path / "hf", **overrides)
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    assert convert_main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "c"), "--text",
                         "a longer text of forty-odd bytes, read as its UTF-8 bytes"]) == 0
    assert "logits: max |diff| = " in capsys.readouterr().out
    ours, cfg = _ours(tmp_path / "c")
    assert cfg.qk_norm and cfg.head_dim == 16 and cfg.attention_head_dim == 16
    assert cfg.sliding_window == overrides.get("sliding_window", 0)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        assert (ours(ids) - theirs).abs().max().item() < 1e-4
    if cfg.sliding_window:  # the window matters: the same weights without it differ
        unwindowed, _ = _ours(tmp_path / "c", sliding_window=0)
        with torch.no_grad():
            assert (unwindowed(ids) - theirs).abs().max().item() > 1e-3
    if kind == "qwen3_moe":
        assert cfg.moe_ffn_hidden_size == 16 and cfg.moe_aux_loss_coeff == 0.001
        assert cfg.moe_norm_topk_prob == overrides["norm_topk_prob"]
        assert cfg.moe_dense_layers == ([0, 2, 3] if overrides.get("decoder_sparse_step") else [])
        assert [type(b.mlp) for b in ours.layers.values()] == [MLP if i in cfg.moe_dense_layers else MoELayer
                                                               for i in range(4)]
        flipped, _ = _ours(tmp_path / "c", moe_norm_topk_prob=not cfg.moe_norm_topk_prob)  # the flag matters
        with torch.no_grad():
            assert (flipped(ids) - theirs).abs().max().item() > 1e-3

    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "back")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "back")
    if overrides.get("tie_word_embeddings"):
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(back)
    assert all(torch.equal(t, back[n]) for n, t in original.items())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("model_type", "head_dim", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                "moe_intermediate_size", "tie_word_embeddings", "use_sliding_window", "sliding_window"):
        assert written.get(key) == source.get(key), key
    reloaded = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, theirs)


@pytest.mark.parametrize("case", ["qwen3_tied", "qwen3_moe_sparse_step_mlp_only_raw_topk"])
def test_greedy_kv_cache_decoding_equals_transformers_generate(case, tmp_path):
    from mmtrain.convert import hf_to_mmtrain
    from mmtrain.inference.engine import DecodeEngine, generate
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.inference.sampling import SamplingParams
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    kind, overrides = CASES[case]
    hf = _random_hf(kind, tmp_path / "hf", **overrides)
    hf_to_mmtrain(tmp_path / "hf", tmp_path / "c", tp=2)
    init_distributed()
    try:
        model, _ = load_checkpoint_model(tmp_path / "c", ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57))]
    ours = generate(DecodeEngine(model, slots=3, max_len=64), prompts, SamplingParams(max_new_tokens=32))
    for p, s in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert s.token_ids == out[0, len(p):].tolist()
    assert len({t for s in ours for t in s.token_ids}) > 6  # not one token repeated: the comparison means something


def test_head_dim_sets_projections_rope_cache_spec_and_flops():
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                      head_dim=16, vocab_size=64, qk_norm=True)
    model = GPTModel(cfg)
    attn = model.layers["0"].attn
    assert attn.qkv.weight.shape == (4 * 16 + 2 * 2 * 16, 32) and attn.proj.weight.shape == (32, 64)
    assert attn.q_norm.weight.shape == (16,) and model.inv_freq.shape == (8,)
    assert model.new_kv_cache(2, 8, torch.float32, "cpu").k[0].shape == (2, 2, 8, 16)
    spec = llama_sharding_spec(cfg)
    assert spec["layers.0.attn.qkv.weight"].parts == (64, 32, 32) and spec["layers.0.attn.qkv.weight"].unit == 16
    assert spec["layers.0.attn.proj.weight"].unit == 16
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    # attention term: 6 x L x S x (heads x head_dim), twice the width here
    assert flops_per_token(cfg, 10) - flops_per_token(cfg, 0) == 6.0 * 2 * 10 * 64
    model.init_weights(0)
    with torch.no_grad():
        assert model(torch.randint(0, 64, (2, 5))).shape == (2, 5, 64)
    derived = dataclasses.replace(cfg, head_dim=0, hidden_size=64)  # 0: hidden / heads
    assert derived.attention_head_dim == 16
    assert model_family(derived).architecture(derived)["head_dim"] == 16  # a run with 0 loads head_dim 16 weights


def _run_cfg(*extra):
    return load_config(GPTRunConfig, None, ["data.mock=true", "model.num_layers=4", *extra])


@pytest.mark.parametrize("extra,message", [
    (["model.head_dim=7"], "model.head_dim (7) must be even"),
    (["model.hidden_size=66"], "must be divisible by model.num_attention_heads (4), or set model.head_dim"),
    (["model.moe_dense_layers=[0]"], "model.num_experts=0"),
    (["model.num_experts=4", "model.moe_dense_layers=[4]"], "layer 4 is past the last layer"),
    (["model.num_experts=4", "model.moe_dense_layers=[1,1]"], "lists a layer twice"),
    (["model.num_experts=4", "model.moe_dense_layers=[0,1,2,3]"], "lists every layer"),
    # FP8 with FSDP gathers 16-aligned weights: 4 heads of 18 make q 72 wide
    (["model.head_dim=18", "train.precision=fp8", "parallel.fsdp=true"], "model.num_attention_heads x head dim"),
])
def test_shape_checks_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_gpt_config(_run_cfg(*extra), 1)


def test_head_dim_apart_from_width_validates():
    validate_gpt_config(_run_cfg("model.hidden_size=66", "model.head_dim=16"), 1)
    validate_gpt_config(_run_cfg("model.num_experts=4", "model.moe_dense_layers=[0,2]", "model.head_dim=32"), 1)


def test_dense_layers_build_spec_flops_and_experts():
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, vocab_size=64,
                      num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_dense_layers=[0, 2])
    model = GPTModel(cfg)
    assert [isinstance(b.mlp, MoELayer) for b in model.layers.values()] == [False, True, False, True]
    spec = llama_sharding_spec(cfg)
    assert set(spec) - {"output.weight"} == set(model.state_dict()) - {"output.weight"}
    assert spec["layers.0.mlp.up.weight"].parts == (48, 48) and spec["layers.1.mlp.experts.w_up"].expert_dim == 0
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    dense_layer, moe_layer = 3 * 32 * 48, 2 * 3 * 32 * 16 + 4 * 32  # active: top-2 experts + the router
    all_moe = dataclasses.replace(cfg, moe_dense_layers=[])
    assert count_parameters(cfg, active=True) - count_parameters(all_moe, active=True) == 2 * (dense_layer - moe_layer)
    assert model_family(cfg).has_routed_experts(cfg)
    reordered = dataclasses.replace(cfg, moe_dense_layers=[2, 0])  # the same model: a run may load its weights
    assert model_family(cfg).architecture(cfg) == model_family(cfg).architecture(reordered)
    stage = GPTModel(cfg, layer_range=(2, 4))  # a pipeline stage: global indices decide
    assert [isinstance(b.mlp, MoELayer) for b in stage.layers.values()] == [False, True]


def test_router_renormalizes_the_top_k_only_when_asked():
    base = ModelConfig(hidden_size=8, num_experts=6, moe_top_k=3)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    router = _Router(base)
    torch.nn.init.normal_(router.weight)
    weights, ids, _, _ = router(x)
    probs = (x @ router.weight.t()).softmax(-1)
    top = probs.gather(1, ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))  # Mixtral, the default: as before
    raw = _Router(dataclasses.replace(base, moe_norm_topk_prob=False))
    raw.load_state_dict(router.state_dict())
    raw_weights, raw_ids, _, _ = raw(x)
    assert torch.equal(raw_ids, ids)
    torch.testing.assert_close(raw_weights, top)  # Qwen3-MoE's norm_topk_prob: false


# HF's own figures: Qwen3-0.6B 0.6B (0.44B without embeddings), Qwen3-1.7B 1.7B (1.4B), Qwen3-30B-A3B 30.5B
# total, 3.3B active
REAL = {"qwen3-0.6b": (1024, 128, 0.596e9, None), "qwen3-1.7b": (2048, 128, 1.72e9, None),
        "qwen3-30b-a3b": (2048, 128, 30.5e9, 3.35e9), "qwen3-moe-2b": (2048, 128, 1.98e9, 1.08e9)}


@pytest.mark.parametrize("name", sorted(REAL))
def test_bundled_configs_have_the_real_shapes_and_validate(name):
    hidden, head_dim, total, active = REAL[name]
    cfg = load_config(GPTRunConfig, f"configs/models/{name}.yaml", ["data.mock=true"])
    validate_gpt_config(cfg, 1)
    m = cfg.model
    assert (m.name, m.hidden_size, m.attention_head_dim, m.qk_norm, m.vocab_size) == (name, hidden, head_dim, True,
                                                                                        151936)
    assert abs(count_parameters(m) / total - 1) < 0.01
    if active is not None:
        assert m.moe_top_k == 8 and m.moe_norm_topk_prob and not m.moe_dense_layers
        assert abs(count_parameters(m, active=True) / active - 1) < 0.01
    # transformers' model of the shape the adapter writes (what bench/hf_family_baseline.py builds) is ours
    transformers = pytest.importorskip("transformers")
    fields = dict(model_family(m).hf.config_to_hf(m, None))
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
        ours = model_family(m).build_stage(m, (0, m.num_layers), True, True)
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if active else "Qwen3ForCausalLM")
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters()) == count_parameters(m)


def test_real_qwen3_configs_read_as_the_bundled_ones():
    """The Hub's config.json values (as published) read by the adapter give the bundled configs' shapes."""
    common = dict(hidden_act="silu", attention_bias=False, use_sliding_window=False, sliding_window=None,
                  max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None, vocab_size=151936)
    dense = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **common)
    moe = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
               num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               router_aux_loss_coef=0.001, output_router_logits=False, tie_word_embeddings=False, **common)
    for hf, name in ((dense, "qwen3-0.6b"), (moe, "qwen3-30b-a3b")):
        bundled = load_config(GPTRunConfig, f"configs/models/{name}.yaml").model
        read = model_config_from_hf(hf)
        assert model_family(read).architecture(read) == model_family(bundled).architecture(bundled), name


def test_sliding_window_on_some_layers_only_is_refused_in_one_line(tmp_path, capsys):
    _random_hf("qwen3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("layer_types", None)  # the window's layers from max_window_layers: 2 of the 4
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "use_sliding_window": True,
                                                             "sliding_window": 8, "max_window_layers": 2}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use_sliding_window with both sliding and full layers" in err, err
    assert not (tmp_path / "c").exists()
    with pytest.raises(UnsupportedHFConfig, match="head_dim='16' must be an integer"):
        model_config_from_hf({**config, "head_dim": "16"})
