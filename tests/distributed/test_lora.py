"""LoRA: adapters train under TP/SP/PP/DP exactly as in one process (losses, adapter weights), the base stays
frozen, and the spec declares every adapter tensor."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.models.llama.model import GPTModel
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt
from tests.lora_helpers import assert_exports_give_the_adapted_logits, tiny_hf_llama_imported

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=1e-2",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64", "peft.lora.rank=4", "peft.lora.alpha=8",
        "train.eval_every=0"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, mesh.coord.tp, mesh.dims.tp


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("one")), [])[0]


def test_spec_covers_adapters_and_base_is_frozen():
    cfg = load_config(GPTRunConfig, None, BASE)
    model = GPTModel(cfg.model, lora=cfg.peft.lora)
    spec = model.sharding_spec()
    names = dict(model.named_parameters())
    assert set(names) == set(spec)
    trainable = {n for n, p in names.items() if p.requires_grad}
    assert trainable == {n for n in spec if spec[n].adapter}
    assert len(trainable) == 2 * 4 * 2  # A and B of qkv, proj, up, down in each of 2 layers
    assert spec["layers.0.attn.qkv.adapter.lora_B.weight"].parts == spec["layers.0.attn.qkv.weight"].parts
    assert spec["layers.0.attn.proj.adapter.lora_A.weight"].tp == "row"


@pytest.mark.parametrize("world_size,layout", [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.pp=2"]),
    (2, ["parallel.dp=2"]),
])
def test_lora_layout_matches_one_process(single, tmp_path, world_size, layout):
    ref_losses, ref_params, _, _ = single
    out = run_distributed(_train, world_size, str(tmp_path), layout)
    losses = out[-1][0]  # the last rank holds the last pipeline stage
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]
    cfg = load_config(GPTRunConfig, None, BASE)
    spec = GPTModel(cfg.model, lora=cfg.peft.lora).sharding_spec()
    for _, params, tp_rank, tp in out:
        for name, p in params.items():
            expected = tp_shard_of(name, ref_params[name], spec, tp_rank, tp)
            torch.testing.assert_close(p, expected, rtol=1e-4, atol=1e-6, msg=name)
    # the adapters trained; the base did not move from its initial values
    init = GPTModel(cfg.model, lora=cfg.peft.lora)
    init.init_weights(cfg.train.seed)
    for name, p in init.named_parameters():
        moved = not torch.equal(p.detach(), ref_params[name])
        assert moved == (name.endswith("lora_B.weight") or name.endswith("lora_A.weight")), name


def _lora_from_hf(rank: int, world_size: int, ckpt: str, run_dir: str, ids: torch.Tensor):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=3",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "parallel.tp=2", "peft.lora.rank=4", "peft.lora.alpha=16", f"checkpoint.load={ckpt}",
        f"logging.run_dir={run_dir}"])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


def test_lora_from_hf_exports_merged_and_peft_adapter(tmp_path):
    """A TP2 LoRA run started from an HF import: the merged HF export loads in transformers with the adapted
    model's logits, and the peft adapter on the HF base gives the same logits through PeftModel."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf, ids = tiny_hf_llama_imported(tmp_path)
    adapted = run_distributed(_lora_from_hf, 2, str(tmp_path / "base"), str(tmp_path / "run"), ids)[0]
    with torch.no_grad():
        base_logits = hf(ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapters changed the model
    adapter = assert_exports_give_the_adapted_logits(tmp_path, str(tmp_path / "run" / "checkpoints"), ids, adapted)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_lora_checkpoint_saved_at_tp2_resumes_at_one_process(single, tmp_path):
    """A LoRA run stopped at step 2 under TP2 (checkpoint: frozen base + adapters + their optimizer state)
    continues in one process exactly as the uninterrupted run."""
    ref_losses, ref_params, _, _ = single
    first = run_distributed(_train, 2, str(tmp_path), ["parallel.tp=2", "train.exit_at_step=2"])
    rest = run_distributed(_train, 1, str(tmp_path), [])[0]
    torch.testing.assert_close(torch.tensor(first[-1][0] + rest[0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, p in rest[1].items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-6, msg=name)
