"""``python -m mmtrain.convert`` for the DeepSeek-V3 family: HF folder -> TP2 x PP2 weights-only checkpoint ->
HF folder is exact, the checkpoint's model gives HF's logits, and its model.yaml is a valid run config. The
converter reads the family from the HF ``model_type`` and the checkpoint's ``model.family`` (registry)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import ConvertError, load_model_weights, read_full_state  # noqa: E402
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from mmtrain.models.deepseek_v3.model import DeepseekV3Model  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
             n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             max_position_embeddings=256, tie_word_embeddings=False)


def _hf_folder(path):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SMALL)).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def test_cli_round_trip_is_exact_and_the_checkpoint_computes_hf_logits(tmp_path, capsys):
    hf_model = _hf_folder(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2", "--pp", "2"]) == 0
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    assert "wrote Hugging Face folder" in capsys.readouterr().out
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "o")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], t) for n, t in original.items())
    assert json.loads((tmp_path / "o" / "config.json").read_text())["model_type"] == "deepseek_v3"

    full, cfg, _ = read_full_state(tmp_path / "c")
    assert cfg.family == "deepseek_v3" and cfg.deepseek_v3.kv_lora_rank == 16
    ours = DeepseekV3Model(cfg.deepseek_v3)
    ours.load_state_dict(full, strict=True)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours.eval()(ids) - hf_model(ids).logits).abs().max().item() < 1e-4

    run = load_config(GPTRunConfig, tmp_path / "c" / "model.yaml", ["data.mock=true"])  # include-able as is
    validate_gpt_config(run)
    assert run.model.family == "deepseek_v3" and run.model.deepseek_v3 == cfg.deepseek_v3


def test_weights_of_another_shape_are_refused_naming_the_key(tmp_path):
    import dataclasses
    from types import SimpleNamespace

    _hf_folder(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 0
    _, cfg, _ = read_full_state(tmp_path / "c")
    other = dataclasses.replace(cfg, deepseek_v3=dataclasses.replace(cfg.deepseek_v3, kv_lora_rank=8))
    mesh = SimpleNamespace(dims=SimpleNamespace(tp=1, ep=1), coord=SimpleNamespace(tp=0, ep=0))
    with pytest.raises(ConvertError, match=r"model\.deepseek_v3\.kv_lora_rank: run 8, checkpoint 16"):
        load_model_weights(tmp_path / "c", mesh, torch.nn.Module(), run_model_cfg=other)
    with pytest.raises(ConvertError, match=r"model\.family: run 'llama', checkpoint 'deepseek_v3'"):
        load_model_weights(tmp_path / "c", mesh, torch.nn.Module(), run_model_cfg=type(cfg)())


def test_an_unreadable_deepseek_config_is_one_line_exit_2(tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    capsys.readouterr()  # drop save_pretrained's progress output
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "hidden_act" in err and err.count("\n") == 1


@pytest.mark.parametrize("change,message", [
    ({"vocab_size": 10**12}, "config.json: vocab_size=1000000000000, but the weights hold 96: "
                             "model.embed_tokens.weight has shape (96, 32)"),
    ({"moe_intermediate_size": 10**9}, "config.json: moe_intermediate_size=1000000000, but the weights hold 16: "
                                       "model.layers.1.mlp.experts.0.gate_proj.weight has shape (16, 32)"),
    ({"n_routed_experts": 16, "n_group": 8}, "config.json: n_routed_experts=16, but the weights hold 8 experts"),
    ({"kv_lora_rank": 32}, "config.json: kv_lora_rank + qk_rope_head_dim=36, but the weights hold 20: "
                           "model.layers.0.self_attn.kv_a_proj_with_mqa.weight has shape (20, 32)"),
    ({"num_hidden_layers": 10**7}, "config.json: num_hidden_layers=10000000, but the weights hold 3 layers"),
    ({"num_hidden_layers": -1}, "config.json: num_hidden_layers=-1 must be an integer >= 1"),
], ids=["vocab", "moe_ffn", "experts", "kv_rank", "layers", "negative_layers"])
def test_a_config_that_contradicts_its_weights_is_one_line_and_writes_nothing(change, message, tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "c").exists()
