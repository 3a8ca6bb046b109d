"""Mistral (``model.sliding_window``) under the parallel layouts: TP2, TP2 with sequence parallelism, PP2 and DP2
train exactly like one process with a window shorter than the sequence, on packed documents (window ∩ document
mask; fp32, CPU, gloo; tolerances as tests/distributed/test_gpt_parallel_equivalence.py), while the same run
without the window trains differently. A LoRA run on an imported ``MistralForCausalLM`` exports merged weights and
a peft adapter that give the adapted model's logits on inputs longer than the window. All world-2 runs share ONE
group of processes, the world-1 runs another."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt
from tests.lora_helpers import assert_exports_give_the_adapted_logits

PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
BASE = ["data.mock=true", "data.seq_length=32", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=1", "optim.lr=3e-3",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64", "model.sliding_window=5", "checkpoint.save_final=false",
        *PACKED]
LAYOUTS = [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2"],
           ["parallel.dp=2"]]
HF_SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, sliding_window=5)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp


def _lora_from_hf(rank: int, world_size: int, run_dir: str, ckpt: str, ids: torch.Tensor):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "peft.lora.rank=4", "peft.lora.alpha=16", f"checkpoint.load={ckpt}", f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


def _jobs(rank: int, world_size: int, run_dir: str, jobs: list[tuple[str, tuple]]) -> list:
    """Several runs in one group of processes, one after the other, each in its own run folder."""
    return [globals()[fn](rank, world_size, f"{run_dir}/{i}", *args) for i, (fn, args) in enumerate(jobs)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from mmtrain.convert.__main__ import main as convert

    hf_root = tmp_path_factory.mktemp("hf_mistral")
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**HF_SHAPE)).eval()
    hf.save_pretrained(hf_root / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(hf_root / "hf"), "--out", str(hf_root / "base")]) == 0
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    one_dir = tmp_path_factory.mktemp("one")
    one = run_distributed(_jobs, 1, str(one_dir), [
        ("_train", ([],)), ("_train", (["model.sliding_window=0"],)),
        ("_lora_from_hf", (str(hf_root / "base"), ids))])[0]
    two = run_distributed(_jobs, 2, str(tmp_path_factory.mktemp("two")), [("_train", (layout,)) for layout in LAYOUTS],
                          timeout_s=400.0)
    return {"one": one, "two": two, "hf": (hf, hf_root, ids), "one_dir": one_dir}


def test_the_window_changes_training(runs):
    windowed, unwindowed = runs["one"][0][0], runs["one"][1][0]
    assert max(abs(a - b) for a, b in zip(windowed, unwindowed)) > 1e-4


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[",".join(layout) for layout in LAYOUTS])
def test_layout_with_a_window_matches_one_process(runs, index):
    ref_losses, ref_params, _, _ = runs["one"][0]
    spec = llama_sharding_spec(load_config(GPTRunConfig, None, BASE).model)
    for per_rank in runs["two"]:
        losses, params, coord, tp = per_rank[index]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name], spec, coord[0], tp)
            rel = (value - expected).norm() / expected.norm().clamp_min(1e-12)
            assert rel < 2e-5, f"{LAYOUTS[index]}: {name} differs by {rel:.2e} (rank coord {coord})"


def test_lora_on_imported_mistral_exports_merged_and_peft_adapter(runs, tmp_path):
    pytest.importorskip("peft")
    import shutil

    hf, hf_root, ids = runs["hf"]
    adapted = runs["one"][2]
    with torch.no_grad():
        assert (adapted - hf(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    shutil.copytree(hf_root / "hf", tmp_path / "hf")  # the helper reads the HF base at tmp_path/hf
    ckpts = str(runs["one_dir"] / "2" / "checkpoints")  # the LoRA run: job 2 of the one-process group
    assert_exports_give_the_adapted_logits(tmp_path, ckpts, ids, adapted)
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged["model_type"] == "mistral" and merged["sliding_window"] == 5
