"""The Nemotron-H hybrid family (mmtrain/models/nemotron_h): the model computes what transformers'
NemotronHForCausalLM computes (logits to 1e-5 in fp32, every layer kind, biases on), packed documents stay inside
their document in every layer kind (a packed batch equals its documents run one by one: logits and gradients),
the pattern string and the other fields are checked with one-line errors naming the key, the initialization is
per name and as transformers draws A_log / D / dt_bias, the spec covers every tensor, the FLOP count."""

from __future__ import annotations

import math

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.config.loader import ConfigError
from mmtrain.config.schema import LoraConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.models.nemotron_h.config import NemotronHConfig
from mmtrain.models.nemotron_h.flops import count_parameters, flops_per_token, ssd_flops_per_token
from mmtrain.models.nemotron_h.mixer import causal_conv
from mmtrain.models.nemotron_h.model import NemotronHModel

pytestmark = pytest.mark.unit

PATTERN = "M*M-M-*M"
SHAPE = dict(vocab_size=96, hidden_size=32, hybrid_override_pattern=PATTERN, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=6,
             ssm_state_size=5, n_groups=2, conv_kernel=4, chunk_size=4, use_conv_bias=True, use_bias=True,
             mlp_bias=True)


def _model(**overrides) -> NemotronHModel:
    model = NemotronHModel(NemotronHConfig(**{**SHAPE, **overrides}), attention=CausalAttention(documents="dense"))
    model.init_weights(3)
    return model


# ------------------------------------------------------------------------------------ transformers' model
def _hf_names(state: dict, pattern: str) -> dict:
    """transformers' NemotronHForCausalLM tensors under this family's names (q/k/v fused into qkv)."""
    renames = [("model.embeddings.", "embed."), ("model.norm_f.", "norm."), ("lm_head.", "output."),
               ("model.layers.", "layers."), (".up_proj.", ".up."), (".down_proj.", ".down."), (".o_proj.", ".proj.")]
    out = {}
    for name, value in state.items():
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = value
    for i, letter in enumerate(pattern):
        if letter == "*":
            p = f"layers.{i}.mixer."
            out[p + "qkv.weight"] = torch.cat([out.pop(p + f"{x}_proj.weight") for x in "qkv"])
    return out


def test_logits_equal_transformers_nemotron_h():
    """Every layer kind, groups of B/C shared by four heads, chunks of 4 over 19 tokens, GQA, all biases. The dt
    clamp [0.02, inf] is both transformers' time_step_min (what 5.24's mixer clamps at) and its time_step_limit
    (what 5.25's clamps to)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_shape = {k: v for k, v in SHAPE.items()}
    hf_config = transformers.NemotronHConfig(**hf_shape, time_step_min=0.02, time_step_limit=(0.02, math.inf))
    hf_config._attn_implementation = "eager"
    hf = transformers.NemotronHForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial norms, biases and step sizes; larger weights (sharper attention)
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0) if p.ndim == 1 else p * 3)
    ours = NemotronHModel(NemotronHConfig(**SHAPE, time_step_min=0.02, time_step_limit=[0.02, None]),
                          attention=CausalAttention(documents="dense"))
    ours.load_state_dict(_hf_names(hf.state_dict(), PATTERN), strict=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours.eval()(ids)
    assert expected.abs().max() > 1.0  # the check below is not about near-zero logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ packed documents
def test_the_convolution_stays_inside_documents():
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(2, 11, 6, generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    doc_ids = torch.tensor([[0] * 4 + [1] * 2 + [2] * 5, [0] * 1 + [1] * 10])
    packed = causal_conv(x, weight, bias, doc_ids)
    for row in range(2):
        for doc in doc_ids[row].unique():
            where = doc_ids[row] == doc
            alone = causal_conv(x[row:row + 1, where], weight, bias)
            torch.testing.assert_close(packed[row:row + 1, where], alone, rtol=1e-6, atol=1e-6)
    plain = torch.nn.functional.conv1d(x.transpose(1, 2), weight, bias, padding=3, groups=6)[..., :11]
    torch.testing.assert_close(causal_conv(x, weight, bias), plain.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_a_packed_batch_equals_its_documents_run_one_by_one():
    """Rows packed with documents of several lengths (boundaries inside and on the edges of the 4-token chunks):
    every document's logits equal those of the document alone, and the packed loss's gradients equal the sum of
    the documents' -- through the Mamba convolution and scan, the attention mask and the MLPs."""
    model = _model()
    lengths = [[5, 8, 1, 6], [4, 16]]
    S = 20
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, S + 1), generator=g)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])

    model.zero_grad()
    packed_logits = model(tokens[:, :-1], doc_ids_BS=doc_ids)
    model(tokens[:, :-1], tokens[:, 1:], doc_ids_BS=doc_ids).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            piece = slice(start, start + length)
            alone = model(tokens[row:row + 1, piece])
            torch.testing.assert_close(packed_logits[row:row + 1, piece], alone, rtol=1e-5, atol=1e-5)
            labels = tokens[row:row + 1, start + 1:start + length + 1]
            model(tokens[row:row + 1, piece], labels).sum().backward()  # accumulates over the documents
            start += length
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    unpacked = model(tokens[:, :-1])  # the same rows without document ids differ: the documents do mix then
    assert (unpacked - packed_logits).abs().max() > 1e-3


# ------------------------------------------------------------------------------------ config and init
def _run_config(*overrides):
    return load_config(GPTRunConfig, None, ["data.mock=true", "model.family=nemotron_h", *overrides])


@pytest.mark.parametrize("overrides,message", [
    (["model.nemotron_h.hybrid_override_pattern=M*-E"],
     r"^model\.nemotron_h\.hybrid_override_pattern='M\*-E': layer 3 is 'E': mixture-of-experts layers are not "
     r"supported by the nemotron_h family yet; use M, \* or -$"),
    (["model.nemotron_h.hybrid_override_pattern=MM-x"],
     r"^model\.nemotron_h\.hybrid_override_pattern='MM-x': layer 3 is 'x', not a layer letter; use M \(Mamba-2\), "
     r"\* \(attention\) or - \(MLP\)$"),
    (["model.nemotron_h.hybrid_override_pattern="], r"hybrid_override_pattern='': is empty"),
    (["model.nemotron_h.n_groups=3"], r"^model\.nemotron_h\.n_groups=3: must divide mamba_num_heads \(8\)$"),
    (["model.nemotron_h.num_key_value_heads=3"], r"num_key_value_heads=3: must divide num_attention_heads \(4\)"),
    (["model.nemotron_h.time_step_limit=[0.1,0.05]"], r"time_step_limit=\[0\.1, 0\.05\]: high must be above low"),
    (["model.nemotron_h.time_step_limit=[0.1]"], r"time_step_limit=\[0\.1\]: must be \[low, high\]"),
    (["model.nemotron_h.time_step_min=0.5"], r"time_step_min=0\.5: is above time_step_max \(0\.1\)"),
    (["model.nemotron_h.residual_in_fp32=true"], r"residual_in_fp32=True: is not supported"),
    (["model.nemotron_h.ssm_state_size=0"], r"^model\.nemotron_h\.ssm_state_size must be >= 1, got 0$"),
    (["model.nemotron_h.mlp_hidden_act=silu"], r"model\.nemotron_h\.mlp_hidden_act.*expected one of 'relu2'"),
    (["parallel.cp=2"], r"^parallel\.cp=2 is not supported for model\.family=nemotron_h yet"),
    (["parallel.tp=4", "model.nemotron_h.num_key_value_heads=4"],
     r"^model\.nemotron_h\.n_groups \(2\) must be divisible by parallel\.tp \(4\)$"),
    (["parallel.tp=8", "model.nemotron_h.n_groups=8"],
     r"^model\.nemotron_h\.num_attention_heads \(4\) must be divisible by parallel\.tp \(8\)$"),
    (["parallel.ep=2", "parallel.dp=2"], r"parallel\.ep=2 needs mixture-of-experts layers"),
], ids=["moe_letter", "unknown_letter", "empty", "groups", "kv_heads", "dt_limit", "dt_limit_len", "dt_range",
        "fp32_residual", "range", "activation", "cp", "tp_groups", "tp_heads", "ep"])
def test_impossible_shapes_and_layouts_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_gpt_config(_run_config(*overrides), world_size=8)


def test_the_pattern_spells_the_layers():
    cfg = NemotronHConfig(hybrid_override_pattern="M-*M")
    assert cfg.num_layers == 4 and cfg.layer_kinds() == ("mamba", "mlp", "attention", "mamba")
    model = NemotronHModel(cfg)
    assert [type(b.mixer).__name__ for b in model.layers.values()] == ["Mamba2Mixer", "Relu2MLP", "Attention",
                                                                        "Mamba2Mixer"]
    assert cfg.lora_targets() == ("in_proj", "out_proj", "qkv", "proj", "up", "down")
    assert NemotronHConfig(hybrid_override_pattern="MM-").lora_targets() == ("in_proj", "out_proj", "up", "down")


def test_init_is_per_name_and_draws_the_ssm_parameters_as_transformers():
    cfg = NemotronHConfig(**SHAPE)
    whole = _model()
    stage = NemotronHModel(cfg, layer_range=(4, 8), pre_process=False)
    stage.init_weights(3)
    for name, p in stage.named_parameters():
        assert p.equal(whole.state_dict()[name]), name
    mixer = whole.layers["0"].mixer
    assert mixer.A_log.equal(torch.log(torch.arange(1, 9, dtype=torch.float32))) and mixer.D.eq(1).all()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= cfg.time_step_min * (1 - 1e-5) and dt.max() <= cfg.time_step_max * (1 + 1e-5)
    assert not whole.layers["2"].mixer.dt_bias.equal(mixer.dt_bias)  # drawn per layer
    out_std = whole.layers["0"].mixer.out_proj.weight.std().item()
    assert abs(out_std - cfg.initializer_range / math.sqrt(8)) < 0.4 * out_std  # rescaled residual projection


@pytest.mark.parametrize("tied,lora", [(False, None), (True, ("in_proj", "qkv", "down"))], ids=["plain", "tied_lora"])
def test_the_spec_has_one_entry_per_tensor(tied, lora):
    model = NemotronHModel(NemotronHConfig(**SHAPE, tie_word_embeddings=tied),
                           lora=LoraConfig(rank=2, targets=list(lora)) if lora else None)
    spec = model.sharding_spec()
    assert set(spec) == set(model.state_dict()) | {"output.weight"}
    inner, gn, heads = 48, 10, 8
    assert spec["layers.0.mixer.in_proj.weight"].parts == (inner, inner, gn, gn, heads)
    assert spec["layers.0.mixer.conv1d.weight"].parts == (inner, gn, gn)
    assert {spec[f"layers.0.mixer.{n}"].tp for n in ("dt_bias", "A_log", "D", "norm.weight")} == {"column"}
    assert spec["layers.0.mixer.out_proj.weight"].tp == "row"
    assert spec["layers.1.mixer.qkv.weight"].parts == (32, 16, 16)
    if lora:
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in spec if spec[n].adapter}
        assert {n.split(".adapter")[0] for n in spec if spec[n].adapter} == {
            "layers.0.mixer.in_proj", "layers.2.mixer.in_proj", "layers.4.mixer.in_proj", "layers.7.mixer.in_proj",
            "layers.1.mixer.qkv", "layers.6.mixer.qkv", "layers.3.mixer.down", "layers.5.mixer.down"}


def test_flops_count_the_matmuls_attention_and_the_scan():
    cfg = NemotronHConfig(**SHAPE)
    d, v = 32, 96
    mamba_matmul = d * (2 * 48 + 2 * 10 + 8) + 48 * d
    attention_matmul = d * (32 + 16 + 16) + 32 * d
    mlp_matmul = 2 * d * 48
    matmul = 4 * mamba_matmul + 2 * attention_matmul + 2 * mlp_matmul + v * d
    # the Mamba-2 paper's chunked count: Q(GN + HP) + 2HPN + HPN/Q multiply-adds per token, forward
    ssd = 2 * (4 * (2 * 5 + 8 * 6) + 2 * 8 * 6 * 5 + 8 * 6 * 5 / 4)
    assert ssd_flops_per_token(cfg) == ssd
    assert flops_per_token(cfg, 64) == 6 * matmul + 2 * 12 * 4 * 8 * 32 + 4 * 3 * ssd
    assert count_parameters(cfg) == sum(p.numel() for p in NemotronHModel(cfg).parameters())
    tied = NemotronHConfig(**SHAPE, tie_word_embeddings=True)
    assert count_parameters(tied) == sum(p.numel() for p in NemotronHModel(tied).parameters())


# ------------------------------------------------------------------------------------------ configs and the demo run
def test_the_8b_config_is_nemotron_h_8b_and_validates():
    """configs/models/nemotron-h-8b.yaml: nvidia/Nemotron-H-8B-Base-8K's shape, whose values transformers'
    NemotronHConfig takes as its defaults (all but the pattern and the context length, which the 8K checkpoint's
    config.json gives): 8.10B parameters."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config(GPTRunConfig, "configs/models/nemotron-h-8b.yaml", ["data.mock=true", "parallel.tp=8"])
    validate_gpt_config(cfg, world_size=8)
    s, hf = cfg.model.nemotron_h, transformers.NemotronHConfig()
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "mlp_hidden_act", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                "n_groups", "conv_kernel", "chunk_size", "use_conv_bias", "use_bias", "mamba_hidden_act",
                "time_step_min", "time_step_max", "time_step_floor", "layer_norm_epsilon", "tie_word_embeddings"):
        assert getattr(s, key) == getattr(hf, key), key
    pattern = s.hybrid_override_pattern
    assert (len(pattern), pattern.count("M"), pattern.count("*"), pattern.count("-")) == (52, 24, 4, 24)
    assert s.mamba_inner_size == 2 * s.hidden_size and s.max_position_embeddings == 8192
    assert round(count_parameters(s) / 1e9, 2) == 8.10


def test_the_1b_benchmark_shape_is_an_8_to_1_hybrid_of_about_1b():
    cfg = load_config(GPTRunConfig, "configs/models/hybrid-1b.yaml", ["data.mock=true", "parallel.tp=4"])
    validate_gpt_config(cfg, world_size=8)
    s = cfg.model.nemotron_h
    kinds = s.layer_kinds()
    assert kinds.count("mamba") == 8 * kinds.count("attention") and "mlp" in kinds and s.hidden_size == 2048
    assert (s.mamba_head_dim, s.ssm_state_size, s.n_groups, s.vocab_size) == (64, 128, 8, 32000)
    assert 1.0e9 < count_parameters(s) < 1.3e9


def test_the_demo_config_trains_on_the_demo_shards_and_its_loss_falls(tmp_path):
    """configs/gpt/hybrid-demo.yaml through the trainer's entry point, on shards prepared as `python -m mmtrain.demo`
    prepares its corpus (a 512-piece SentencePiece tokenizer, EOD after each document: packed documents)."""
    import json

    from dataprep.cli import main as prep_main
    from dataprep.samples import write_sample_jsonl
    from mmtrain.pretrain_gpt import main as pretrain_main

    raw = write_sample_jsonl(tmp_path / "corpus.jsonl", 300, seed=1)
    assert prep_main(["train-tokenizer", "--input", str(raw), "--output-prefix", str(tmp_path / "sp"),
                      "--vocab-size", "512"]) == 0
    assert prep_main(["text", "--input", str(raw), "--output-prefix", str(tmp_path / "corpus"), "--tokenizer",
                      str(tmp_path / "sp.model"), "--append-eod", "--workers", "1"]) == 0
    assert pretrain_main(["--config", "mmtrain:configs/gpt/hybrid-demo.yaml", f"data.prefixes=[{tmp_path / 'corpus'}]",
                          "train.steps=12", f"logging.run_dir={tmp_path / 'run'}"]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
