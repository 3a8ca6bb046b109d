"""The GPT-OSS family (``model.family: gpt_oss``) trains through the shared loop, and TP2, TP2 with sequence
parallelism, PP2, DP2 and EP2 (over dp2) train exactly like one process: the same losses over the steps and the
same weights after them (fp32, CPU, gloo; to 2e-5 of each tensor's norm, 1e-4 for the MoE under TP, as
tests/distributed/test_gpt_parallel_equivalence.py). Sequences (16) are longer than the sliding window (4), and
one layout trains on packed documents (window ∩ document mask). LoRA on ``qkv``/``proj`` trains the same under
TP2 with SP. Every world-2 layout runs in ONE ``run_distributed`` group, one after the other (``_run_jobs``), and
the world-1 references in another: starting a process group costs more than training these tiny models."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.models.registry import model_family
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

TINY = "configs/models/gpt-oss-tiny.yaml"
BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=1", "optim.lr=3e-3",
        "checkpoint.save_final=false",
        # Adam divides by sqrt(v) + eps: a gradient that is zero but for rounding (the key bias's, near-tied router
        # entries) becomes a full-size step of random sign at eps=1e-8, and layouts that round differently then
        # differ by ~1e-4; at 1e-6 such entries stay small and real gradients still dominate
        "optim.eps=1e-6"]
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
LORA = ["peft.lora.rank=4", "peft.lora.alpha=8", "optim.lr=1e-2"]
# (layout, what the one-process reference shares with it)
LAYOUTS = [
    (["parallel.tp=2"], []),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], []),
    (["parallel.pp=2"], []),
    (["parallel.dp=2"], []),
    (["parallel.dp=2", "parallel.ep=2"], []),
    (["parallel.dp=2", "parallel.ep=2", "parallel.ep_dispatch=padded"], []),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], PACKED),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], LORA),
]
REFERENCES = list(dict.fromkeys(tuple(shared) for _, shared in LAYOUTS)) + [("train.activation_checkpointing=full",)]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, TINY, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp, mesh.dims.ep


def _run_jobs(rank: int, world_size: int, run_dir: str, jobs: list[list[str]]) -> list:
    """Several runs in one group of processes, one after the other, each with its own mesh and run folder."""
    return [_train(rank, world_size, f"{run_dir}/{i}", list(extra)) for i, extra in enumerate(jobs)]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    runs = run_distributed(_run_jobs, 1, str(tmp_path_factory.mktemp("one")), [list(r) for r in REFERENCES])[0]
    return dict(zip(REFERENCES, runs))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> list:
    jobs = [[*layout, *shared] for layout, shared in LAYOUTS]
    return run_distributed(_run_jobs, 2, str(tmp_path_factory.mktemp("two")), jobs, timeout_s=400.0)


def test_one_process_trains_and_full_recompute_changes_nothing(references):
    losses, params, *_ = references[()]
    assert losses[-1] < losses[0]
    assert "layers.0.attn.sinks" in params and "layers.3.mlp.experts.b_up" in params
    torch.testing.assert_close(torch.tensor(references[("train.activation_checkpointing=full",)][0]),
                               torch.tensor(losses), rtol=1e-6, atol=0)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[",".join(layout + shared[:1])
                                                          for layout, shared in LAYOUTS])
def test_layout_matches_one_process(references, layouts, index):
    layout, shared = LAYOUTS[index]
    ref_losses, ref_params, *_ = references[tuple(shared)]
    cfg = load_config(GPTRunConfig, TINY, [*BASE, *shared])
    m = cfg.model
    stage = model_family(m).build_stage(m, (0, m.gpt_oss.num_layers), True, True,
                                        **({"lora": cfg.peft.lora} if cfg.peft.lora.rank else {}))
    spec = stage.sharding_spec()
    seen = set()
    for per_rank in layouts:
        losses, params, coord, tp, ep = per_rank[index]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name], spec, coord[0], tp)
            if spec[name].expert_dim is not None and ep > 1:  # this EP rank's slice of the experts
                expected = expected.chunk(ep, dim=0)[coord[4]]
            rel = ((value - expected).norm() / expected.norm().clamp_min(1e-12)).item()
            # with TP the MoE input carries reduction-order noise that can flip a near-tie in the top-k routing
            tol = 1e-4 if tp > 1 and ".mlp." in name else 2e-5
            assert rel < tol, f"{layout + shared}: {name} at {coord} differs by {rel:.2e} (relative to its norm)"
            seen.add(name)
    assert seen == set(ref_params)  # every parameter was compared on some rank
    if shared == LORA:
        assert any(spec[n].adapter for n in seen)
