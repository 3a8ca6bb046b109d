"""The Hugging Face bridge: logits parity with tiny random HF models, exact round trips, TP/PP split+merge."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.convert import hf_to_mmtrain, mmtrain_to_hf  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import (load_model_weights, merge_shards, read_full_state,  # noqa: E402
                                           split_full_state)
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from mmtrain.models.llama.hf_adapter import UnsupportedHFConfig, model_config_from_hf  # noqa: E402
from mmtrain.models.llama.model import GPTModel  # noqa: E402
from mmtrain.models.llama.spec import llama_sharding_spec  # noqa: E402
from mmtrain.parallel.global_chunks import Shard, chunks_from_global  # noqa: E402
from mmtrain.utils.dcp_io import read_metadata, save_chunks  # noqa: E402

pytestmark = pytest.mark.unit

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _random_hf(kind: str, path, **overrides):
    """A tiny random HF model saved to ``path``; norm weights and biases made non-trivial and q/k scaled up
    (sharp attention, so that RoPE details such as the llama3 scaling show in the logits)."""
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, **overrides}))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**SMALL, **overrides}))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**SMALL, **overrides}))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(25.0)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


def _mmtrain_logits(ckpt, ids, positions):
    full, cfg, _ = read_full_state(ckpt)
    model = GPTModel(cfg)
    model.load_state_dict(full, strict=True)
    with torch.no_grad():
        return model.eval()(ids, position_ids_BS=positions), cfg


CASES = {
    "llama_gqa_untied_llama3_rope": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2_qkv_bias_tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "mixtral_moe": ("mixtral", dict()),
    "llama_head_dim_apart_from_width": ("llama", dict(head_dim=16)),  # 4 heads of 16 in a width of 32
    # windows shorter than the 24 test tokens: a model that ignored them would differ
    "mistral_sliding_window": ("mistral", dict(sliding_window=5)),
    "qwen2_sliding_window_every_layer": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=0)),
    "mixtral_sliding_window": ("mixtral", dict(sliding_window=7)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_and_round_trip_is_exact(case, tmp_path):
    kind, overrides = CASES[case]
    hf_model = _random_hf(kind, tmp_path / "hf", **overrides)
    hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=2)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    # far positions: the llama3 scaling changes only long wavelengths, invisible at positions 0..23
    positions = (torch.arange(24) + 3000).expand(2, 24)
    ours, cfg = _mmtrain_logits(tmp_path / "ckpt", ids, positions)
    with torch.no_grad():
        theirs = hf_model(ids, position_ids=positions).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    if "rope_scaling" in overrides:
        assert cfg.rope_scaling_factor == 8.0 and cfg.rope_theta == 500000.0
    assert cfg.sliding_window == overrides.get("sliding_window", 0)

    mmtrain_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "back")
    if overrides.get("tie_word_embeddings"):
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(back)
    for name, t in original.items():
        assert torch.equal(t, back[name]), name
    reloaded = type(hf_model).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, position_ids=positions).logits, theirs)


@pytest.mark.parametrize("tp,pp,layers", [(2, 2, None), (4, 3, None), (2, 2, [1, 2]), (1, 3, None)])
def test_tp_pp_split_then_merge_is_exact(tp, pp, layers, tmp_path):
    _random_hf("qwen2", tmp_path / "hf", tie_word_embeddings=True)
    cfg = model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    full, _, _ = read_full_state(hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt1"))
    shards = split_full_state(full, cfg, tp, pp, layers)
    assert sorted(shards) == [(r, s) for r in range(tp) for s in range(pp)]
    # a tied last stage without the embedding holds its own copy, as in training
    assert ("output.weight" in shards[(0, pp - 1)]) == (pp > 1)
    assert shards[(1 % tp, 0)]["embed.weight"].shape[0] == cfg.vocab_size // tp
    merged = merge_shards(shards, cfg)
    assert sorted(merged) == sorted(full)
    assert all(torch.equal(merged[n], full[n]) for n in full)


def test_written_layout_reads_back_and_loads_into_one_rank(tmp_path):
    _random_hf("llama", tmp_path / "hf")
    folder = hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=2)
    meta = json.loads((folder / "complete.json").read_text())
    assert meta["weights_only"] is True and meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 2
    assert meta["config"]["parallel"]["tp"] == 2 and (tmp_path / "ckpt" / "latest").read_text().strip() == folder.name
    stored = read_metadata(folder).state_dict_metadata  # DCP: global tensors, each in the boxes 2x2 ranks hold
    assert all(key.startswith("model.") for key in stored)
    assert tuple(stored["model.output.weight"].size) == (96, 32) and len(stored["model.output.weight"].chunks) == 2
    assert len(stored["model.layers.0.attn.qkv.weight"].chunks) == 6  # q, k, v parts, each split over tp=2
    assert len(stored["model.layers.0.attn_norm.weight"].chunks) == 1  # replicated over TP: stored once

    full, cfg, _ = read_full_state(tmp_path / "ckpt")
    expected = split_full_state(full, cfg, 2, 2)[(1, 1)]
    # a stand-in for a TP=2/PP=2 rank's stage: a module whose state holds tensors of that rank's shapes
    holder = torch.nn.Module()
    for i, (name, t) in enumerate(expected.items()):
        holder.register_buffer(f"b{i}", torch.zeros_like(t))
    names = dict(zip(expected, (getattr(holder, f"b{i}") for i in range(len(expected)))))
    holder.state_dict = lambda: names
    mesh = SimpleNamespace(dims=SimpleNamespace(tp=2, ep=1), coord=SimpleNamespace(tp=1, ep=0))
    load_model_weights(tmp_path / "ckpt", mesh, holder, run_model_cfg=cfg)
    assert all(torch.equal(names[n], expected[n]) for n in expected)
    with pytest.raises(ValueError, match="model.rope_theta"):
        load_model_weights(tmp_path / "ckpt", mesh, holder, run_model_cfg=dataclasses.replace(cfg, rope_theta=1.0))


def test_cli_round_trip(tmp_path, capsys):
    _random_hf("llama", tmp_path / "hf", tie_word_embeddings=True)
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2"]) == 0
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    assert "wrote Hugging Face folder" in capsys.readouterr().out
    model_yaml = yaml.safe_load((tmp_path / "c" / "model.yaml").read_text())["model"]
    assert "deepseek_v3" not in model_yaml and model_yaml["family"] == "llama"  # only the family's shape
    assert load_config(GPTRunConfig, tmp_path / "c" / "model.yaml").model == read_full_state(tmp_path / "c")[1]
    back = read_hf_tensors(tmp_path / "o")
    assert all(torch.equal(t, back[n]) for n, t in read_hf_tensors(tmp_path / "hf").items() if n != "lm_head.weight")


def test_hf_to_mmtrain_records_the_folders_tokenizer(tmp_path, capsys):
    """What evaluate / generate / lm_eval check data and tokenizers against, and what mmtrain-to-hf exports."""
    from mmtrain.core.tokenizer import load_tokenizer
    from tests.unit.test_tokenizer import build_hf_bpe

    _random_hf("llama", tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "bare")]) == 0
    assert "no tokenizer recorded" in capsys.readouterr().out
    build_hf_bpe(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 0
    assert f"tokenizer recorded: {tmp_path / 'hf' / 'tokenizer.json'}" in capsys.readouterr().out
    meta = json.loads((tmp_path / "c" / "step_00000000" / "complete.json").read_text())
    assert meta["tokenizer"]["sha256"] == load_tokenizer(tmp_path / "hf").checksum()


@pytest.mark.parametrize("change,key", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 2.0}}, "high_freq_factor"),
    ({"rope_scaling": {**LLAMA3_SCALING, "original_max_position_embeddings": 4096}}, "original_max_position"),
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "max_window_layers"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "decoder_sparse_step": 2, "mlp_only_layers": [1]}, "leave no MoE layer"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "mlp_only_layers": [5]}, "mlp_only_layers"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 must be an integer >= 1"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "max_window_layers"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_unsupported_hf_config_names_the_key(change, key):
    hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 96, **change}
    with pytest.raises(UnsupportedHFConfig, match=key):
        model_config_from_hf(hf)


def test_sharded_hf_folder_in_and_out(tmp_path):
    from mmtrain.convert.hf_files import INDEX_NAME, read_hf_config, write_hf_folder

    hf_model = _random_hf("llama", tmp_path / "hf")
    tensors = read_hf_tensors(tmp_path / "hf")
    write_hf_folder(tmp_path / "sharded", read_hf_config(tmp_path / "hf"), tensors, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf_to_mmtrain(tmp_path / "sharded", tmp_path / "ckpt")
    mmtrain_to_hf(tmp_path / "ckpt", tmp_path / "back")
    back = read_hf_tensors(tmp_path / "back")
    assert all(torch.equal(t, back[n]) for n, t in tensors.items())
    ids = torch.randint(0, SMALL["vocab_size"], (1, 8))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_training_checkpoint_with_data_and_expert_parallel_ranks_merges(tmp_path):
    """A checkpoint as a dp=2, ep=2 run saves it: each rank holds half of the experts, the rest replicated."""
    _random_hf("mixtral", tmp_path / "hf")
    folder = hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt")
    full, cfg, meta = read_full_state(folder)
    dense = split_full_state(full, cfg, 1, 1)[(0, 0)]
    train = tmp_path / "train" / "step_00000007"
    chunks = {}
    for rank in range(2):
        for n, t in dense.items():
            for c in chunks_from_global(f"model.{n}", n, t, llama_sharding_spec(cfg), Shard(ep_rank=rank, ep=2)):
                chunks.setdefault((c.key, c.offsets), c)  # replicas are stored once, as DCP deduplicates them
    assert len([k for k in chunks if k[0].endswith("experts.w_up")]) == 2 * cfg.num_layers
    save_chunks(train, list(chunks.values()), no_dist=True)
    layout = {"world_size": 2, "tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 2}
    (train / "complete.json").write_text(json.dumps({"step": 7, "layout": layout, "config": meta["config"]}))
    merged, _, _ = read_full_state(train)
    assert sorted(merged) == sorted(full) and all(torch.equal(merged[n], full[n]) for n in full)


@pytest.mark.parametrize("field,value,shape", [
    ("norm", "layernorm", {}), ("activation", "gelu", {}),
    ("qkv_bias", True, {"qk_norm": True}),  # Qwen3 has no q/k/v biases
    ("moe_dense_layers", [0], {"num_experts": 4}), ("moe_norm_topk_prob", False, {"num_experts": 4}),  # Mixtral
])
def test_mmtrain_model_without_hf_equivalent_is_refused(field, value, shape):
    from mmtrain.config.schema import ModelConfig
    from mmtrain.models.llama.hf_adapter import hf_config_from_model_config

    with pytest.raises(UnsupportedHFConfig, match=f"model.{field}"):
        hf_config_from_model_config(ModelConfig(**{field: value, **shape}))


# ------------------------------------------------ configs that contradict their weights (issue #29 item 9)
@pytest.mark.parametrize("change,message", [
    ({"vocab_size": 10**12}, "config.json: vocab_size=1000000000000, but the weights hold 96: "
                             "model.embed_tokens.weight has shape (96, 32)"),
    ({"intermediate_size": 10**9}, "config.json: intermediate_size=1000000000, but the weights hold 48: "
                                   "model.layers.0.mlp.gate_proj.weight has shape (48, 32)"),
    ({"num_key_value_heads": 4}, "config.json: num_key_value_heads=4 (x head_dim 8 = 32), but the weights hold 2: "
                                 "model.layers.0.self_attn.k_proj.weight has shape (16, 32)"),
    ({"num_hidden_layers": 10**7}, "config.json: num_hidden_layers=10000000, but the weights hold 3 layers"),
    ({"num_hidden_layers": -1}, "config.json: num_hidden_layers=-1 must be an integer >= 1"),
    ({"hidden_size": "32"}, "config.json: hidden_size='32' must be an integer >= 1"),
], ids=["vocab", "ffn", "kv_heads", "layers", "negative_layers", "string"])
def test_a_config_that_contradicts_its_weights_is_one_line_and_writes_nothing(change, message, tmp_path, capsys):
    _random_hf("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m mmtrain.convert hf-to-mmtrain: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "c").exists()


def test_hf_to_mmtrain_refuses_an_out_that_holds_checkpoints(tmp_path, capsys):
    _random_hf("llama", tmp_path / "hf")
    run = tmp_path / "run" / "checkpoints"  # a training run's checkpoints: latest names step 40
    (run / "step_00000040").mkdir(parents=True)
    (run / "latest").write_text("step_00000040\n")
    capsys.readouterr()  # drop save_pretrained's progress output
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {run}: already holds checkpoints (latest, step_00000040)" in err
    assert (run / "latest").read_text() == "step_00000040\n" and sorted(p.name for p in run.iterdir()) == [
        "latest", "step_00000040"]
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]) == 0
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]) == 2
    (tmp_path / "empty").mkdir()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "empty")]) == 0
