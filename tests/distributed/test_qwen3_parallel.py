"""Qwen3 and Qwen3-MoE shapes of the Llama family (heads of 16 in a width of 32, q/k RMSNorm; Qwen3-MoE: raw
top-k weights, a dense first layer) train at TP2, TP2 with sequence parallelism, PP2 and DP2 (Qwen3-MoE: EP2 over
DP2) exactly like one process: same losses, same weights (fp32, CPU, gloo; tolerances as
tests/distributed/test_gpt_parallel_equivalence.py). A LoRA run started from each transformers model's import
exports a merged folder and a peft adapter that give the adapted model's logits. All runs of a world size go
through one ``run_distributed`` call (starting a process group costs more than these tiny runs)."""

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

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=1", "optim.lr=3e-3",
        "checkpoint.save_final=false"]
QWEN3 = ["model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.head_dim=16", "model.qk_norm=true", "model.vocab_size=64"]
SHAPES = {"qwen3": [*QWEN3, "model.tie_embeddings=true"],
          "qwen3_moe": [*QWEN3, "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
                        "model.moe_norm_topk_prob=false", "model.moe_dense_layers=[0]",
                        "model.moe_aux_loss_coeff=1e-3"]}
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = [("qwen3", ["parallel.tp=2"]), ("qwen3", SP), ("qwen3", ["parallel.pp=2"]), ("qwen3", ["parallel.dp=2"]),
           ("qwen3_moe", ["parallel.dp=2", "parallel.ep=2"]), ("qwen3_moe", SP), ("qwen3_moe", ["parallel.pp=2"])]
# the transformers models the LoRA runs start from (4 heads of 16 in a width of 32, as above)
HF_SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64)
HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
              decoder_sparse_step=2)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp


def _lora_from_hf(rank: int, world_size: int, run_dir: str, ckpt: str, ids: torch.Tensor):
    """A LoRA run (every target the shape allows) from an imported checkpoint; the adapted model's logits."""
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "peft.lora.rank=4",
        "peft.lora.alpha=16", f"checkpoint.load={ckpt}", f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


def _run_jobs(rank: int, world_size: int, run_dir: str, jobs: list[tuple[str, tuple]]) -> list:
    """Several runs in one group of processes, one after the other, each in its own run folder."""
    return [globals()[fn](rank, world_size, f"{run_dir}/{i}", *args) for i, (fn, args) in enumerate(jobs)]


def _hf_imported(kind: str, folder):
    """A random tiny transformers model of ``kind`` saved at ``folder/hf`` and imported at ``folder/base``."""
    transformers = pytest.importorskip("transformers")
    from mmtrain.convert.__main__ import main as convert

    torch.manual_seed(0)
    if kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**HF_SHAPE))
    else:
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_SHAPE, **HF_MOE))
    hf.save_pretrained(folder / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(folder / "hf"), "--out", str(folder / "base")]) == 0
    return hf.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run this file compares: the one-process references and LoRA runs in one world-1 call, the layouts
    in one world-2 call."""
    pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("qwen3")
    ids = torch.randint(0, HF_SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    hf = {kind: _hf_imported(kind, tmp / kind) for kind in SHAPES}
    one_jobs = [("_train", (SHAPES[kind],)) for kind in SHAPES]
    one_jobs += [("_lora_from_hf", (str(tmp / kind / "base"), ids)) for kind in SHAPES]
    one = run_distributed(_run_jobs, 1, str(tmp / "one"), one_jobs, timeout_s=300.0)[0]
    two_jobs = [("_train", ([*SHAPES[k], *layout],)) for k, layout in LAYOUTS]
    two = run_distributed(_run_jobs, 2, str(tmp / "two"), two_jobs, timeout_s=400.0)
    return {"reference": dict(zip(SHAPES, one[:2])), "layouts": [[per_rank[i] for per_rank in two]
                                                                 for i in range(len(LAYOUTS))],
            "lora": {kind: (tmp / kind, tmp / "one" / str(2 + i), hf[kind], logits)
                     for i, (kind, logits) in enumerate(zip(SHAPES, one[2:]))}, "ids": ids}


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{k}:{','.join(v)}" for k, v in LAYOUTS])
def test_layout_matches_one_process(runs, index):
    kind, layout = LAYOUTS[index]
    ref_losses, ref_params, _, _ = runs["reference"][kind]
    cfg = load_config(GPTRunConfig, None, [*BASE, *SHAPES[kind]]).model
    spec = llama_sharding_spec(cfg)
    seen = set()
    for losses, params, coord, tp in runs["layouts"][index]:  # coord: (tp, cp, dp, pp, ep, edp)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name if name in ref_params else "embed.weight"], spec, coord[0], tp)
            if ".experts.w_" in name:  # this EP rank's slice of the experts
                expected = expected[coord[4] * value.shape[0]:(coord[4] + 1) * value.shape[0]]
            # relative to the tensor's norm; MoE under TP: a near-tie in top-k routing may flip for an odd token
            rel = ((value - expected).norm() / expected.norm().clamp_min(1e-12)).item()
            tol = 1e-4 if (tp > 1 and ".mlp." in name and cfg.num_experts) else 2e-5
            assert rel < tol, f"{layout}: {name} differs by {rel:.2e} (relative to its norm) at {coord}"
            seen.add(name if name in ref_params else "embed.weight")
    assert seen == set(ref_params)  # every tensor was compared on some rank


@pytest.mark.parametrize("kind", list(SHAPES))
def test_lora_from_hf_exports_merged_and_peft_adapter(runs, kind):
    folder, run_dir, hf, adapted = runs["lora"][kind]
    ids = runs["ids"]
    with torch.no_grad():
        assert (adapted - hf(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    adapter = assert_exports_give_the_adapted_logits(folder, str(run_dir / "checkpoints"), ids, adapted)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["gate_proj", "up_proj", "down_proj"] if kind == "qwen3"
                                                          else [])  # an MoE model: attention adapters only
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
