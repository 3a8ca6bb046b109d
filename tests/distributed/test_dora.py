"""DoRA (``peft.lora.dora``): the adapted model starts as the base, its forward/backward equals peft's DoRA on the
HF model holding the same weights, TP2 (and SP, PP2) train as one process, and the exports (peft adapter, merged
weights) and the generation loader's merge give the adapted model's logits."""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
import torch
import torch.nn.functional as F

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.model.lora import DoRAAdapter, LoRALinear, reset_dora_magnitudes
from mmtrain.models.llama.model import GPTModel
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import allreduce_tp_partial_grads, apply_tensor_parallel, tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt
from tests.lora_helpers import assert_exports_give_the_adapted_logits, tiny_hf_llama_imported

SHAPE = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=64"]
DORA = ["peft.lora.rank=4", "peft.lora.alpha=8", "peft.lora.dora=true"]
BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=3",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=1e-2",
        "train.eval_every=0", *SHAPE, *DORA]


@torch.no_grad()
def _randomize_adapters(model: torch.nn.Module, seed: int = 7) -> None:
    """Non-zero B, magnitudes away from the row norms: every DoRA term (and the row norms) matters."""
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("lora_B.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif name.endswith("adapter.magnitude"):
            p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))


def test_dora_linear_equals_the_fp64_formula():
    torch.manual_seed(0)
    linear = LoRALinear(torch.nn.Linear(6, 5, dtype=torch.float64), rank=2, alpha=4.0, dora=True).double()
    ad = linear.adapter
    assert isinstance(ad, DoRAAdapter)
    x = torch.randn(3, 6, dtype=torch.float64)
    with torch.no_grad():
        ad.lora_B.weight.zero_()  # as the models' init_weights start it
    reset_dora_magnitudes(linear)  # B = 0: the row norms of W, the base linear's output
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=0, atol=1e-14)
    with torch.no_grad():
        ad.lora_B.weight.normal_()
        ad.magnitude.mul_(torch.rand(5, dtype=torch.float64) + 0.5)
    out = linear(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in ad.named_parameters()}
    A, B, m = (t.detach().clone().requires_grad_() for t in (ad.lora_A.weight, ad.lora_B.weight, ad.magnitude))
    w = linear.weight.detach() + 2.0 * B @ A
    want = F.linear(x, m[:, None] * w / w.norm(dim=1, keepdim=True).detach(), linear.bias.detach())
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for name, t in (("lora_A.weight", A), ("lora_B.weight", B), ("magnitude", m)):
        torch.testing.assert_close(grads[name], t.grad, rtol=0, atol=1e-12, msg=name)


def test_dora_config_is_checked():
    cfg = load_config(GPTRunConfig, None, [*BASE, "peft.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"^peft\.lora\.dora=true needs .*peft\.lora\.rank > 0"):
        validate_gpt_config(cfg, 1)


def test_dora_matches_peft_on_the_hf_model():
    """Our DoRA model on HF Qwen2 weights: at step 0 the base's logits; with trained-looking adapters the same
    logits, loss and adapter gradients as peft's DoRA on the HF model with the exported adapter."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from mmtrain.models.llama.hf_adapter import mmtrain_state_from_hf, model_config_from_hf
    from mmtrain.models.llama.lora_export import peft_adapter

    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(  # Qwen2: q/k/v biases (kept out of DoRA's norm)
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=64)).float()
    mcfg = model_config_from_hf(hf.config.to_dict())
    lora = load_config(GPTRunConfig, None, DORA).peft.lora
    ours = GPTModel(mcfg, lora=lora)
    ours.init_weights(0)  # B at zero
    missing, unexpected = ours.load_state_dict(mmtrain_state_from_hf(hf.state_dict(), mcfg), strict=False)
    assert not unexpected and all(".adapter." in n for n in missing)
    reset_dora_magnitudes(ours)  # as loading base weights does
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=2e-5)  # step 0: the base model
    _randomize_adapters(ours)
    full = {n: t.detach() for n, t in ours.state_dict().items()}
    config, tensors = peft_adapter(full, mcfg, dataclasses.replace(lora, targets=list(lora.targets_for(mcfg))))
    assert config["use_dora"] is True and any(k.endswith("lora_magnitude_vector") for k in tensors)
    keep = {k: v for k, v in config.items() if k in peft.LoraConfig.__dataclass_fields__}
    theirs = peft.get_peft_model(hf, peft.LoraConfig(**{**keep, "inference_mode": False}))
    peft.set_peft_model_state_dict(theirs, tensors)
    logits = ours(ids)
    ref = theirs(ids).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=2e-5)
    F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
    F.cross_entropy(ref.flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
    peft_grads = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    q = "base_model.model.model.layers.1.self_attn."
    qkv = ours.get_submodule("layers.1.attn.qkv").adapter
    names = ("q_proj", "k_proj", "v_proj")
    cat = {"lora_B.weight": torch.cat([peft_grads[f"{q}{n}.lora_B.default.weight"] for n in names]),
           "magnitude": torch.cat([peft_grads[f"{q}{n}.lora_magnitude_vector.default.weight"] for n in names]),
           "lora_A.weight": sum(peft_grads[f"{q}{n}.lora_A.default.weight"] for n in names)}  # one shared A
    for name, want in cat.items():
        torch.testing.assert_close(qkv.get_parameter(name).grad, want, rtol=1e-4, atol=1e-6, msg=name)
    down = ours.get_submodule("layers.0.mlp.down").adapter
    d = "base_model.model.model.layers.0.mlp.down_proj."
    torch.testing.assert_close(down.magnitude.grad, peft_grads[f"{d}lora_magnitude_vector.default.weight"],
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(down.lora_A.weight.grad, peft_grads[f"{d}lora_A.default.weight"], rtol=1e-4, atol=1e-6)


def _tp_grads(rank: int, world_size: int, ids: torch.Tensor):
    """Loss and adapter gradients of the randomized DoRA model, sharded over TP2 (row linears' norms summed)."""
    cfg = load_config(GPTRunConfig, None, BASE)
    mesh = ParallelDims(world_size, tp=world_size).build()
    model = GPTModel(cfg.model, lora=cfg.peft.lora)
    model.init_weights(cfg.train.seed)
    _randomize_adapters(model)
    apply_tensor_parallel(model, mesh.tp_group)
    loss = model(ids[:, :-1], ids[:, 1:]).sum()
    loss.backward()
    allreduce_tp_partial_grads(model, mesh.tp_group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads, mesh.coord.tp


def test_dora_tp2_loss_and_grads_equal_one_process():
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(3))
    ref_loss, ref, _ = run_distributed(_tp_grads, 1, ids)[0]
    assert any(n.endswith("magnitude") for n in ref) and all(g.abs().sum() > 0 for g in ref.values())
    cfg = load_config(GPTRunConfig, None, BASE)
    spec = GPTModel(cfg.model, lora=cfg.peft.lora).sharding_spec()
    for loss, grads, tp_rank in run_distributed(_tp_grads, 2, ids):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert set(grads) == set(ref)
        for name, g in grads.items():
            torch.testing.assert_close(g, tp_shard_of(name, ref[name], spec, tp_rank, 2), rtol=1e-4, atol=1e-6,
                                       msg=name)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    return result.losses, {k: v.detach().clone() for k, v in result.model.named_parameters()}, mesh.coord.tp


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("one")), [])[0]


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2"],
                                    ["parallel.dp=2", "parallel.fsdp=true", "parallel.distributed_optimizer=true"]],
                         ids=["tp2-sp", "pp2", "dp2-fsdp"])
def test_dora_layouts_train_as_one_process(single, tmp_path, layout):
    ref_losses, ref_params, _ = single
    out = run_distributed(_train, 2, str(tmp_path / "two"), layout)
    torch.testing.assert_close(torch.tensor(out[-1][0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    cfg = load_config(GPTRunConfig, None, BASE)
    spec = GPTModel(cfg.model, lora=cfg.peft.lora).sharding_spec()
    tp = 2 if "parallel.tp=2" in layout else 1
    for _, params, tp_rank in out:
        for name, p in params.items():
            torch.testing.assert_close(p, tp_shard_of(name, ref_params[name], spec, tp_rank, tp), rtol=1e-4,
                                       atol=1e-6, msg=name)
    init = GPTModel(cfg.model, lora=cfg.peft.lora)
    init.init_weights(cfg.train.seed)
    assert not torch.equal(init.get_parameter("layers.1.attn.proj.adapter.magnitude"),
                           ref_params["layers.1.attn.proj.adapter.magnitude"])  # the magnitudes trained


def _dora_from_hf(rank: int, world_size: int, ckpt: str, run_dir: str, ids: torch.Tensor):
    from mmtrain.inference.loading import load_checkpoint_model

    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=3",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "parallel.tp=2", "peft.lora.rank=4", "peft.lora.alpha=16", "peft.lora.dora=true", f"checkpoint.load={ckpt}",
        f"logging.run_dir={run_dir}"])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        adapted = result.model.eval()(ids)
        merged, _ = load_checkpoint_model(f"{run_dir}/checkpoints", mesh, "cpu", torch.float32)  # generate/serve
        assert not any(".adapter." in n for n in merged.state_dict())
        return adapted, merged(ids)


def test_dora_from_hf_exports_merged_and_peft_adapter(tmp_path):
    """A TP2 DoRA run started from an HF import: the generation loader's merge (per TP shard), the merged HF export
    in transformers and the peft adapter on the HF base through PeftModel all give the adapted model's logits."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf, ids = tiny_hf_llama_imported(tmp_path)
    adapted, merged_tp = run_distributed(_dora_from_hf, 2, str(tmp_path / "base"), str(tmp_path / "run"), ids)[0]
    with torch.no_grad():
        base_logits = hf(ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters changed the model
    torch.testing.assert_close(merged_tp, adapted, rtol=0, atol=1e-4)
    adapter = assert_exports_give_the_adapted_logits(tmp_path, str(tmp_path / "run" / "checkpoints"), ids, adapted)
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True


def test_dora_deepseek_v3_tp2_sp_trains_as_one_process(tmp_path):
    from tests.distributed.test_lora_deepseek_v3 import _cfg, _stage
    from tests.distributed.test_lora_deepseek_v3 import _train as train_deepseek

    dora = ["peft.lora.dora=true", "train.steps=2"]
    ref_losses, ref_params, *_ = run_distributed(train_deepseek, 1, str(tmp_path / "one"), dora)[0]
    out = run_distributed(train_deepseek, 2, str(tmp_path / "two"),
                          [*dora, "parallel.tp=2", "parallel.sequence_parallel=true"])
    torch.testing.assert_close(torch.tensor(out[-1][0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    spec = _stage(_cfg(dora)).sharding_spec()
    assert spec["layers.0.attn.kv_down.adapter.magnitude"].tp_partial_grad == "always"  # opens the TP region
    assert spec["layers.0.attn.q_up.adapter.magnitude"].tp == "column"
    for _, params, tp_rank, tp, *_ in out:
        for name, p in params.items():
            torch.testing.assert_close(p, tp_shard_of(name, ref_params[name], spec, tp_rank, tp), rtol=1e-4,
                                       atol=1e-4, msg=name)


def test_dora_deepseek_v3_peft_adapter_and_merge_match_the_hf_model():
    """DeepSeek-V3 DoRA on HF weights (attention targets, trained-looking adapters): peft's DoRA with the exported
    adapter and the merged weights in transformers give the adapted model's logits."""
    from tests.distributed.test_lora_deepseek_v3 import _hf_model
    peft = pytest.importorskip("peft")
    from mmtrain.models.deepseek_v3.hf_adapter import config_from_hf, state_dict_from_hf, state_dict_to_hf
    from mmtrain.models.deepseek_v3.lora_export import merge_lora, peft_adapter
    from mmtrain.models.deepseek_v3.model import DeepseekV3Model

    _, hf = _hf_model()
    cfg = config_from_hf(hf.config.to_dict())
    lora = dataclasses.replace(load_config(GPTRunConfig, None, DORA).peft.lora,
                               targets=["q_down", "q_up", "kv_down", "kv_up", "proj"])
    ours = DeepseekV3Model(cfg, lora=lora)
    ours.init_weights(0)
    missing, unexpected = ours.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=False)
    assert not unexpected and all(".adapter." in n for n in missing)
    reset_dora_magnitudes(ours)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    _randomize_adapters(ours)
    full = {n: t.detach() for n, t in ours.state_dict().items()}
    with torch.no_grad():
        adapted = ours.eval()(ids)
        merged = state_dict_to_hf(merge_lora(full, cfg, lora), cfg, experts_layout="module")
        config, tensors = peft_adapter(full, cfg, lora)
        keep = {k: v for k, v in config.items() if k in peft.LoraConfig.__dataclass_fields__}
        theirs = peft.get_peft_model(hf, peft.LoraConfig(**keep))
        peft.set_peft_model_state_dict(theirs, tensors)
        torch.testing.assert_close(theirs.eval()(ids).logits, adapted, rtol=0, atol=1e-4)
        hf_merged = theirs.unload()  # the HF base again, without the adapter
        hf_merged.load_state_dict(merged)
        torch.testing.assert_close(hf_merged(ids).logits, adapted, rtol=0, atol=1e-4)
