"""The gemma3 family (``model.family: gemma3``) trains through the shared loop: TP2, TP2 with sequence
parallelism (also on packed documents), PP2 (the tied embedding's copy on the last stage) and DP2 train exactly
like one process -- the same losses and the same weights after the steps (fp32, CPU, gloo; to 2e-5 of each
tensor's norm). Sequences of 24 tokens and windows of 6 on half the layers: a layout that lost the window would
differ from the reference (which computes it). All layouts of a world size run in ONE group of processes, one
after the other (``_run_jobs``). A LoRA run from an HF model exports a ``peft`` adapter that ``PeftModel`` loads
with the adapted model's logits, and a merged model with the same logits."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.models.registry import model_family
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

SHAPE = ["model.family=gemma3", "model.gemma3.vocab_size=64", "model.gemma3.hidden_size=32",
         "model.gemma3.intermediate_size=64", "model.gemma3.num_layers=4", "model.gemma3.num_attention_heads=4",
         "model.gemma3.num_key_value_heads=2", "model.gemma3.head_dim=8", "model.gemma3.query_pre_attn_scalar=8",
         "model.gemma3.sliding_window=6", "model.gemma3.final_logit_softcapping=20.0", "model.gemma3.init_std=0.1"]
BASE = ["data.mock=true", "data.seq_length=24", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=1", "optim.lr=3e-3",
        "checkpoint.save_final=false", *SHAPE]
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
LAYOUTS = [(["parallel.tp=2"], []), (["parallel.tp=2", "parallel.sequence_parallel=true"], []),
           (["parallel.tp=2", "parallel.sequence_parallel=true"], PACKED), (["parallel.pp=2"], []),
           (["parallel.dp=2"], [])]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp


def _run_jobs(rank: int, world_size: int, run_dir: str, jobs: list[list[str]]) -> list:
    """Several runs in one group of processes, one after the other, each with its own mesh and run folder."""
    return [_train(rank, world_size, f"{run_dir}/{i}", extra) for i, extra in enumerate(jobs)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference runs by data overrides, [(layout, per-rank results)])."""
    datas = [[], PACKED]
    one = run_distributed(_run_jobs, 1, str(tmp_path_factory.mktemp("one")), datas)[0]
    two = run_distributed(_run_jobs, 2, str(tmp_path_factory.mktemp("two")), [[*l, *d] for l, d in LAYOUTS],
                          timeout_s=400.0)
    return ({tuple(d): r for d, r in zip(datas, one)},
            [(layout, [per_rank[i] for per_rank in two]) for i, layout in enumerate(LAYOUTS)])


def test_one_process_learns(runs):
    for losses, _, _, _ in runs[0].values():
        assert losses[-1] < losses[0]


def test_every_layout_matches_one_process(runs):
    reference, layouts = runs
    cfg = load_config(GPTRunConfig, None, BASE).model
    spec = model_family(cfg).sharding_spec(cfg)
    for (layout, data), results in layouts:
        ref_losses, ref_params, _, _ = reference[tuple(data)]
        seen = set()
        for losses, params, coord, tp in results:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                       msg=lambda m, lay=layout: f"{lay}: {m}")
            for name, value in params.items():  # the last stage's tied copy of the embedding is checked as it
                expected = tp_shard_of(name, ref_params[spec.stored_name(name)], spec, coord[0], tp)
                # relative to the tensor's norm (as test_gpt_parallel_equivalence.py: Adam's g/sqrt(v) lets fp32
                # reduction-order noise move single elements by ~1e-6); a norm weight relative to the scale it
                # applies, 1 + w: it starts at zero, so after a few steps its own norm is a few learning rates
                scale = expected + 1 if name.endswith("norm.weight") else expected
                rel = ((value - expected).norm() / scale.norm().clamp_min(1e-12)).item()
                assert rel < 2e-5, f"{layout}{data}: {name} at {coord} differs by {rel:.2e} (relative to its norm)"
                seen.add(spec.stored_name(name))
        assert seen == set(ref_params), layout


# ------------------------------------------------------------------------------------------------ LoRA export
def _lora_from_hf(rank: int, world_size: int, ckpt: str, run_dir: str, ids: torch.Tensor):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=24", "train.precision=fp32", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "peft.lora.rank=4", "peft.lora.alpha=16", f"checkpoint.load={ckpt}", f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    result = train_gpt(cfg, ParallelDims.from_config(cfg.parallel, world_size).build(), torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


def test_lora_from_hf_exports_a_peft_adapter_and_a_merged_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from mmtrain.convert.__main__ import main as convert

    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=8,
        max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    adapted = run_distributed(_lora_from_hf, 1, str(tmp_path / "base"), str(tmp_path / "run"), ids)[0]
    with torch.no_grad():
        assert (adapted - hf(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    ckpts = str(tmp_path / "run" / "checkpoints")
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    adapted_modules = {n.rpartition(".")[2] for n, m in with_adapter.named_modules() if hasattr(m, "lora_A")}
    assert adapted_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-4)
        torch.testing.assert_close(with_adapter(ids).logits, adapted, rtol=0, atol=1e-4)
