"""LoRA on the DeepSeek-V3 family (MLA's projections, the dense MLP, the shared experts) and on Llama MoE
models: TP2 (with sequence parallelism), EP2 over DP2 and PP2 train exactly as one process (losses, adapter
weights; the base stays frozen); the merged HF export equals the adapted model, and the peft adapter on the HF
base matches it through PeftModel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.config.schema import LoraConfig
from mmtrain.convert.checkpoint_io import read_full_state
from mmtrain.convert.hf_files import write_peft_adapter
from mmtrain.models.deepseek_v3.hf_adapter import state_dict_to_hf
from mmtrain.models.deepseek_v3.lora_export import merge_lora, peft_adapter
from mmtrain.models.registry import model_family
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

TINY = "configs/models/deepseek-v3-tiny.yaml"
BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=3",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=1e-2",
        "train.eval_every=0", "model.deepseek_v3.vocab_size=64", "peft.lora.rank=4", "peft.lora.alpha=8"]


def _cfg(extra=()):
    return load_config(GPTRunConfig, TINY, [*BASE, *extra])


def _stage(cfg):
    m = cfg.model
    return model_family(m).build_stage(m, (0, m.deepseek_v3.num_layers), True, True, lora=cfg.peft.lora)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, TINY, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, mesh.coord.tp, mesh.dims.tp, mesh.coord.ep, mesh.dims.ep


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("one")), [])[0]


def test_targets_spec_and_frozen_base():
    model = _stage(_cfg())
    spec = model.sharding_spec()
    names = dict(model.named_parameters())
    assert set(names) <= set(spec)
    trainable = {n for n, p in names.items() if p.requires_grad}
    assert trainable == {n for n in spec if spec[n].adapter}
    # layer 0 dense: q_down q_up kv_down kv_up proj up down; layers 1-2 MoE: the same attention + shared up/down
    assert len(trainable) == 2 * (7 + 7 + 7)
    assert not any("experts." in n for n in trainable)
    assert spec["layers.0.attn.kv_down.adapter.lora_B.weight"].tp_partial_grad == "always"  # opens the TP region
    assert spec["layers.0.attn.q_up.adapter.lora_B.weight"].tp == "column"
    assert spec["layers.1.mlp.shared.down.adapter.lora_A.weight"].tp == "row"
    only = _stage(_cfg(["peft.lora.targets=[kv_up,shared_down]"]))
    assert {n for n, p in only.named_parameters() if p.requires_grad} == {
        f"layers.{i}.{linear}.adapter.lora_{x}.weight" for x in "AB"
        for i, linear in [(0, "attn.kv_up"), (1, "attn.kv_up"), (2, "attn.kv_up"), (1, "mlp.shared.down"),
                          (2, "mlp.shared.down")]}


@pytest.mark.parametrize("extra,match", [
    (["peft.lora.targets=[qkv]"], r"peft\.lora\.targets: qkv is not a linear of this model \(model\.family="
                                  r"deepseek_v3\); choose from q_down, q_up, kv_down"),
    (["peft.lora.targets=[q_proj]"], "q_proj is not a linear"),  # the tiny shape has a query latent
])
def test_targets_the_shape_lacks_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        validate_gpt_config(_cfg(extra), 1)


def test_llama_moe_allows_attention_targets_only():
    llama = ["data.mock=true", "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
             "model.num_attention_heads=4", "model.vocab_size=64", "model.num_experts=4", "model.moe_top_k=2",
             "peft.lora.rank=4"]
    cfg = load_config(GPTRunConfig, None, llama)
    validate_gpt_config(cfg, 1)
    assert cfg.peft.lora.targets_for(cfg.model) == ("qkv", "proj")
    with pytest.raises(ConfigError, match=r"up is not a linear of this model \(model\.family=llama\); "
                                          r"choose from qkv, proj"):
        validate_gpt_config(load_config(GPTRunConfig, None, [*llama, "peft.lora.targets=[qkv,up]"]), 1)


@pytest.mark.parametrize("world_size,layout", [
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.dp=2", "parallel.ep=2"]),
    (2, ["parallel.pp=2"]),
], ids=lambda v: ",".join(v) if isinstance(v, list) else str(v))
def test_layout_matches_one_process(single, tmp_path, world_size, layout):
    ref_losses, ref_params, *_ = single
    assert ref_losses[-1] < ref_losses[0]
    out = run_distributed(_train, world_size, str(tmp_path), layout)
    torch.testing.assert_close(torch.tensor(out[-1][0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    spec = _stage(_cfg()).sharding_spec()
    for _, params, tp_rank, tp, ep_rank, ep in out:  # Adam noise on near-zero gradients: atol 1% of lr
        for name, p in params.items():
            expected = tp_shard_of(name, ref_params[name], spec, tp_rank, tp)
            if spec[name].expert_dim is not None and ep > 1:
                expected = expected.chunk(ep, dim=spec[name].expert_dim)[ep_rank]
            torch.testing.assert_close(p, expected, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    init = _stage(_cfg())
    init.init_weights(_cfg().train.seed)
    for name, p in init.named_parameters():  # the adapters trained, the base did not move
        assert (not torch.equal(p.detach(), ref_params[name])) == spec[name].adapter, name


def _hf_model():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    torch.manual_seed(0)
    return transformers, transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, tie_word_embeddings=False)).eval()


def _lora_from_hf(rank: int, world_size: int, ckpt: str, run_dir: str, ids: torch.Tensor):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "peft.lora.rank=4", "peft.lora.alpha=16", f"checkpoint.load={ckpt}",
        f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


def test_lora_from_hf_exports_merged_and_peft_adapter(tmp_path, capsys):
    """DeepseekV3ForCausalLM -> a LoRA run on every target (one process: the layouts are checked above): the merged export loads in transformers with the
    adapted model's logits; the attention adapters as a peft adapter (full module paths) on the HF base give the
    HF model with those adapters merged through PeftModel; the MLP adapters' peft export is refused."""
    transformers, hf = _hf_model()
    peft = pytest.importorskip("peft")
    from mmtrain.convert.__main__ import main as convert

    hf.save_pretrained(tmp_path / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    adapted = run_distributed(_lora_from_hf, 1, str(tmp_path / "base"), str(tmp_path / "run"), ids)[0]
    with torch.no_grad():
        assert (adapted - hf(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    ckpts = str(tmp_path / "run" / "checkpoints")
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-4)
    # MLP targets have no peft form (peft maps gate/up/down_proj onto the routed experts): refused in one line
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "mlp"), "--lora", "adapter"]) == 2
    assert "peft.lora.targets up, down, shared_up, shared_down: peft maps" in capsys.readouterr().err
    assert not (tmp_path / "mlp").exists()
    # the attention adapters of the same run as a peft adapter: PeftModel on the HF base equals the HF model with
    # those adapters merged (the MLP ones left out)
    full, cfg, _ = read_full_state(ckpts)
    lora = dataclasses.replace(LoraConfig(rank=4, alpha=16), targets=["q_down", "q_up", "kv_down", "kv_up", "proj"])
    write_peft_adapter(tmp_path / "adapter", *peft_adapter(full, cfg.deepseek_v3, lora))
    attention_merged = merged  # reloaded in place with only the attention adapters merged
    attention_merged.load_state_dict(state_dict_to_hf(merge_lora(full, cfg.deepseek_v3, lora), cfg.deepseek_v3,
                                                      experts_layout="module"))
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()  # wraps the HF base in place
    adapted_modules = {n for n, m in with_adapter.named_modules() if hasattr(m, "lora_A")}
    assert "base_model.model.model.layers.1.self_attn.kv_a_proj_with_mqa" in adapted_modules
    assert not any("mlp" in n for n in adapted_modules)
    with torch.no_grad():
        expected = attention_merged(ids).logits
        assert (expected - adapted).abs().max() > 1e-4  # the MLP adapters mattered: the check is not vacuous
        torch.testing.assert_close(with_adapter(ids).logits, expected, rtol=0, atol=1e-4)
