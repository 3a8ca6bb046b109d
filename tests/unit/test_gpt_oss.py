"""The GPT-OSS family (``model.family: gpt_oss``, mmtrain/models/gpt_oss/): MXFP4 dequantization equals
transformers' own, YaRN frequencies equal transformers', ``GptOssForCausalLM`` -> ``hf-to-mmtrain`` (TP2 x PP2)
-> ``compare`` gives its logits and ``mmtrain-to-hf`` gives its tensors back bit for bit, an MXFP4 Hub-layout
folder imports as transformers loads it, greedy KV-cache decoding equals transformers ``generate``, and the
shapes in configs/models/ load and validate. Every sequence is longer than the sliding window (4 or 6), so a
model ignoring the window, the sinks or the layer types fails."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.config.schema import ModelConfig  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import read_full_state  # noqa: E402
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from mmtrain.models.gpt_oss.config import GptOssConfig  # noqa: E402
from mmtrain.models.gpt_oss.family import count_parameters  # noqa: E402
from mmtrain.models.gpt_oss.hf_adapter import config_from_hf  # noqa: E402
from mmtrain.models.gpt_oss.model import GptOssModel, rope_inv_freq  # noqa: E402
from mmtrain.models.gpt_oss.mxfp4 import Mxfp4Error, dequantize  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
             max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
TEXT = "the quick brown fox jumps over the lazy dog"  # 43 byte ids: longer than every window here


def _hf_model(**overrides):
    """A tiny random GptOssForCausalLM with non-trivial biases, sinks and norms, q/k scaled up (sharp attention,
    so the window, the sinks and RoPE show in the logits)."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20.0)
            elif name.endswith(("sinks", "bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "experts" in name or name.endswith("router.weight"):
                p.mul_(10.0)
    return model.eval()


# ------------------------------------------------------------------------------------------ MXFP4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 250, (3, 40, 4), dtype=torch.uint8, generator=g)  # subnormal to large powers
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize("gate_up_proj", blocks, scales, dtype, rows_per_chunk=7)  # chunks cut through experts
    assert got.dtype == dtype and got.shape == expected.shape == (3, 4 * 32, 40)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("blocks,scales,message", [
    (torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.full((2, 4, 3), 255, dtype=torch.uint8),
     "p_scales holds the NaN scale byte 255"),
    (torch.full((2, 4, 3, 16), 0x77, dtype=torch.uint8), torch.full((2, 4, 3), 254, dtype=torch.uint8),
     "p: a block's scale makes its values overflow to infinity"),
    (torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8),
     r"p_scales has shape \(2, 4, 2\); p_blocks \(2, 4, 3, 16\) needs one scale per block: \(2, 4, 3\)"),
    (torch.zeros(2, 4, 3, 8, dtype=torch.uint8), torch.zeros(2, 4, 3, dtype=torch.uint8),
     r"p_blocks has shape \(2, 4, 3, 8\); expected \(\.\.\., blocks, 16\)"),
    (torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, dtype=torch.uint8), "dtypes torch.float32 / torch.uint8"),
], ids=["nan_scale", "overflow", "scales_shape", "block_bytes", "dtype"])
def test_mxfp4_refuses_damaged_blocks(blocks, scales, message):
    with pytest.raises(Mxfp4Error, match=message):
        dequantize("p", blocks, scales)


# ------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("rope", [
    SMALL["rope_parameters"],
    {**SMALL["rope_parameters"], "truncate": True, "beta_fast": 16.0},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,  # gpt-oss-20b
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    {"rope_type": "default", "rope_theta": 10000.0},
], ids=["tiny", "truncated", "gpt-oss-20b", "default"])
def test_rope_frequencies_and_factor_equal_transformers(rope):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf_config = transformers.GptOssConfig(**{**SMALL, "head_dim": 64, "max_position_embeddings": 131072,
                                             "rope_parameters": rope})
    hf = GptOssRotaryEmbedding(hf_config)
    cfg = config_from_hf(hf_config.to_dict())
    assert torch.equal(rope_inv_freq(cfg), hf.inv_freq)  # bit for bit: same fp32 operations
    assert cfg.yarn_attention_factor() == hf.attention_scaling


# ------------------------------------------------------------------------------------------ conversion
def test_hf_to_mmtrain_gives_hf_logits_and_mmtrain_to_hf_gives_its_tensors_back(tmp_path, capsys):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    assert convert_main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "c"), "--text", TEXT,
                         "--tol", "1e-4"]) == 0
    assert "logits: max |diff|" in capsys.readouterr().out
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "o")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], t) for n, t in original.items())
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["layer_types"][:2] == ["sliding_attention", "full_attention"]

    # the window, the sinks and the layer types each show in the logits (so the parity above is not vacuous)
    full, cfg, _ = read_full_state(tmp_path / "c")
    assert cfg.family == "gpt_oss" and cfg.gpt_oss.sliding_window == 6
    ids = torch.tensor([list(TEXT.encode())]) % SMALL["vocab_size"]
    with torch.no_grad():
        expected = hf(ids).logits
        for change in ({"sliding_window": 10**4}, {"layer_types": ["full_attention"] * 4}):
            other = GptOssModel(GptOssConfig(**{**vars(cfg.gpt_oss), **change})).eval()
            other.load_state_dict(full)
            assert (other(ids) - expected).abs().max() > 1e-3, change
        no_sinks = GptOssModel(cfg.gpt_oss).eval()
        no_sinks.load_state_dict({**full, **{k: torch.full_like(v, -1e4) for k, v in full.items()
                                            if k.endswith("sinks")}})
        assert (no_sinks(ids) - expected).abs().max() > 1e-3

    run = load_config(GPTRunConfig, tmp_path / "c" / "model.yaml", ["data.mock=true"])  # include-able as is
    validate_gpt_config(run)
    assert run.model == cfg and run.model.gpt_oss == cfg.gpt_oss


def _as_mxfp4_folder(src, dst) -> None:
    """The Hub checkpoints' layout: ``src``'s experts replaced by random MXFP4 blocks and scales, config.json
    with ``quantization_config`` (mxfp4)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, cols_out = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, cols_out, rows_in // 32, 16), dtype=torch.uint8,
                                                  generator=g)
        tensors[name + "_scales"] = torch.randint(120, 126, (experts, cols_out, rows_in // 32), dtype=torch.uint8,
                                                  generator=g)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_imports_as_transformers_loads_it_and_exports_bf16(tmp_path, capsys):
    _hf_model().save_pretrained(tmp_path / "dense")
    _as_mxfp4_folder(tmp_path / "dense", tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 0
    full, _, _ = read_full_state(tmp_path / "c")
    assert full["layers.0.mlp.experts.w_up"].dtype == torch.bfloat16  # dequantized, not requantized
    assert full["layers.0.mlp.experts.w_up"].shape == (4, 64, 64)
    capsys.readouterr()
    # transformers dequantizes the same folder itself on a CPU: the same model
    assert convert_main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "c"), "--text", TEXT,
                         "--tol", "1e-4"]) == 0, capsys.readouterr().out
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "quantization_config" not in config
    exported = read_hf_tensors(tmp_path / "o")
    assert exported["model.layers.1.mlp.experts.down_proj"].dtype == torch.bfloat16
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    assert convert_main(["compare", "--hf", str(tmp_path / "o"), "--ckpt", str(tmp_path / "c"), "--text",
                         TEXT]) == 0


@pytest.mark.parametrize("change,message", [
    ({"vocab_size": 10**12}, "config.json: vocab_size=1000000000000, but the weights hold 96: "
                             "model.embed_tokens.weight has shape (96, 64)"),
    ({"num_local_experts": 8}, "config.json: num_local_experts=8, but the weights hold 4: "),
    ({"head_dim": 8}, "config.json: num_attention_heads=4 (x head_dim 8 = 32), but the weights hold "),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method='fp8' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types=['full_attention']: has 1 entries; it needs one per layer"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                       "attention_factor": 2.0}}, "rope_parameters.attention_factor is not supported"),
    ({"num_hidden_layers": -1}, "config.json: num_hidden_layers=-1 must be an integer >= 1"),
    ({"rms_norm_eps": "small"}, "config.json: rms_norm_eps='small' must be a number"),
    ({"attention_bias": 1}, "config.json: attention_bias=1 must be bool"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "x", "original_max_position_embeddings": 32}},
     "config.json: rope_parameters.factor='x' must be a number"),
], ids=["vocab", "experts", "head_dim", "quant", "layer_types", "attention_factor", "negative_layers", "eps_type",
        "bias_type", "rope_type"])
def test_a_bad_hf_folder_is_one_line_and_writes_nothing(change, message, tmp_path, capsys):
    _hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if "rope_scaling" in change:
        config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "c").exists()


def test_mxfp4_blocks_of_another_shape_are_refused_naming_the_key(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _hf_model().save_pretrained(tmp_path / "dense")
    _as_mxfp4_folder(tmp_path / "dense", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.2.mlp.experts.down_proj_scales"] = tensors["model.layers.2.mlp.experts.down_proj_scales"][
        :, :, :0]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "intermediate_size / 32=1, but the weights hold 0" in err and \
        "model.layers.2.mlp.experts.down_proj_scales" in err, err


# ------------------------------------------------------------------------------------------ decoding
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], list(range(40, 57)), [30, 31, 7]]


def test_greedy_decoding_equals_transformers_generate(tmp_path):
    """Our checkpoint (TP2 layout) -> mmtrain-to-hf; greedy KV-cache decoding of 4 rows at once equals
    transformers' generate of each row, and so does ``python -m mmtrain.generate`` (in-process) on a text
    prompt: 24 new tokens each, well past the window of 4."""
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.generate import main as generate_main
    from mmtrain.inference.engine import DecodeEngine, generate
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.inference.sampling import SamplingParams
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed
    from tests.inference_helpers import tiny_checkpoint, tiny_tokenizer

    shape = GptOssConfig(vocab_size=512, hidden_size=48, num_layers=3, sliding_window=4, init_std=0.3,
                         max_position_embeddings=256, yarn_factor=8.0, yarn_original_max_position_embeddings=32)
    ckpt = tiny_checkpoint(tmp_path / "ckpt", ModelConfig(family="gpt_oss", gpt_oss=shape), tp=2)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "GptOssForCausalLM"

    def hf_greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    init_distributed()
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    ours = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, SamplingParams(max_new_tokens=24))
    for p, s in zip(PROMPTS, ours):
        assert s.token_ids == hf_greedy(p)
    tok = tiny_tokenizer(tmp_path / "tok")
    prompt = "The quick brown fox jumps over the lazy dog."
    assert generate_main(["--ckpt", str(ckpt), "--tokenizer", str(tok), "--prompt", prompt, "--max-new-tokens", "24",
                          "--no-eod-stop", "--output", str(tmp_path / "out.jsonl")]) == 0
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["token_ids"] == hf_greedy(load_tokenizer(str(tok)).encode_batch([prompt])[0])


# ------------------------------------------------------------------------------------------ configs
def test_the_20b_config_is_the_hf_shape_and_validates():
    cfg = load_config(GPTRunConfig, "configs/models/gpt-oss-20b.yaml",
                      ["data.mock=true", "parallel.tp=8", "parallel.ep=4"])
    validate_gpt_config(cfg, world_size=32)
    s = cfg.model.gpt_oss
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim,
            s.num_local_experts, s.num_experts_per_tok, s.sliding_window, s.vocab_size) == (
        24, 2880, 64, 8, 64, 32, 4, 128, 201088)
    assert [s.window(i) for i in range(4)] == [128, None, 128, None]
    assert round(count_parameters(s) / 1e9, 1) == 20.9  # the model card's total
    tiny = load_config(GPTRunConfig, "configs/models/gpt-oss-tiny.yaml", ["data.mock=true"])
    validate_gpt_config(tiny, world_size=1)
    assert tiny.model.family == "gpt_oss"


@pytest.mark.parametrize("overrides,message", [
    (["model.gpt_oss.layer_types=[full_attention]"], r"model\.gpt_oss\.layer_types=\['full_attention'\]: has 1"),
    (["model.gpt_oss.layer_types=[sliding_attention,full_attention,dense,full_attention]"],
     r"'dense' is not one of sliding_attention, full_attention"),
    (["model.gpt_oss.sliding_window=0"], r"model\.gpt_oss\.sliding_window=0: must be positive when a layer"),
    (["model.gpt_oss.num_key_value_heads=3"], r"model\.gpt_oss\.num_key_value_heads=3: must divide"),
    (["model.gpt_oss.num_experts_per_tok=5"], r"num_experts_per_tok=5: must not exceed num_local_experts \(4\)"),
    (["parallel.cp=2"], r"parallel\.cp=2 is not supported for model\.family=gpt_oss"),
    (["parallel.tp=4"], r"model\.gpt_oss\.num_key_value_heads \(2\) must be divisible by parallel\.tp \(4\)"),
    (["parallel.ep=8", "parallel.dp=8"], r"model\.gpt_oss\.num_local_experts \(4\) must be divisible by "
                                         r"parallel\.ep \(8\)"),
    (["model.num_experts=4"], r"model\.num_experts=4 belongs to model family llama but model\.family=gpt_oss "
                              r"ignores it"),
    (["peft.lora.rank=4", "peft.lora.targets=[up]"], r"up is not a linear of this model \(model\.family=gpt_oss\); "
                                                     r"choose from qkv, proj"),
], ids=["layer_types_len", "layer_type", "window", "kv_heads", "top_k", "cp", "tp", "ep", "llama_field", "lora"])
def test_impossible_shapes_and_layouts_are_refused_naming_the_key(overrides, message):
    cfg = load_config(GPTRunConfig, "configs/models/gpt-oss-tiny.yaml", ["data.mock=true", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_gpt_config(cfg, world_size=8)


@pytest.mark.parametrize("tied,lora", [(False, None), (True, ("qkv", "proj"))], ids=["plain", "tied_lora"])
def test_the_spec_has_one_entry_per_tensor(tied, lora):
    from mmtrain.config.schema import LoraConfig

    cfg = GptOssConfig(tie_word_embeddings=tied)
    model = GptOssModel(cfg, lora=LoraConfig(rank=2, targets=list(lora)) if lora else None)
    spec = model.sharding_spec()
    assert set(spec) == set(model.state_dict()) | {"output.weight"}
    assert spec["layers.0.attn.sinks"].tp == "column" and spec["layers.0.attn.qkv.bias"].parts == (64, 32, 32)
    assert spec["layers.3.mlp.experts.b_up"].expert_dim == 0 and spec["layers.3.mlp.router.bias"].tp == "replicated"
    if lora:
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in spec if spec[n].adapter}
