"""Save at one layout, resume at another: the continuation matches the run that never changed layout
(weights and Adam state resharded; 1e-5 relative, the fp32 reduction-order noise of the new layout)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=5",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=3e-3",
        "model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.vocab_size=64", "checkpoint.save_every=3", "checkpoint.keep_last=0"]
MOE = ["model.num_experts=4", "model.moe_ffn_hidden_size=32"]


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


@pytest.mark.parametrize("saved, loaded, model", [
    ((4, ["parallel.tp=2", "parallel.pp=2"]), (1, []), []),
    # saved with DP2 too: the distributed optimizer's flat ranges of TP shards (cut where the DP halves meet) reshard to TP4
    ((4, ["parallel.tp=2", "parallel.dp=2"]), (4, ["parallel.tp=4"]), []),
    ((2, ["parallel.dp=2"]), (1, []), []),
    ((2, ["parallel.dp=2", "parallel.ep=2"]), (1, []), MOE),
    ((1, []), (4, ["parallel.pp=2", "parallel.dp=2", "parallel.tp=1"]), ["model.tie_embeddings=true"]),
    ((2, ["parallel.pp=2", "parallel.virtual_pp=2"]), (1, []), ["model.tie_embeddings=true"]),
], ids=["tp2pp2-to-1", "tp2dp2-to-tp4", "dp2-to-1", "ep2-to-ep1", "1-to-pp2dp2-tied", "vpp2-to-1-tied"])
def test_resume_at_another_layout(tmp_path, saved, loaded, model):
    (n_saved, saved_layout), (n_loaded, loaded_layout) = saved, loaded
    full = run_distributed(_train, n_saved, str(tmp_path / "a"), [*saved_layout, *model])[0]
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000003", tmp_path / "b" / "checkpoints" / "step_00000003")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_00000003\n")
    tail = run_distributed(_train, n_loaded, str(tmp_path / "b"), [*loaded_layout, *model])[0]
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(full[3:]), rtol=1e-5, atol=0)


def _cp_logits_then_train(rank: int, world_size: int, run_dir: str, extra: list[str], ids: torch.Tensor):
    """Train to the step-3 checkpoint (or just load it), return the full-sequence logits of the model then,
    and the losses of steps 4-5 resumed from it."""
    import torch.distributed as dist

    from mmtrain.parallel.context import shard_sequence, zigzag_global_order

    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", "train.exit_at_step=3", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    model = train_gpt(cfg, mesh, torch.device("cpu")).model.eval()
    cp, positions = mesh.dims.cp, torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        local = model(shard_sequence(ids, cp, mesh.coord.cp), None, shard_sequence(positions, cp, mesh.coord.cp))
    if cp > 1:
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=mesh.cp_group)
        local = zigzag_global_order(torch.cat(parts, dim=1), cp, 1)
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    return local, train_gpt(cfg, mesh, torch.device("cpu")).losses


def test_context_parallel_checkpoint_loads_without_it(tmp_path):
    """CP2 (distributed optimizer sharded over the two CP ranks) -> CP1: same logits, training goes on alike."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits_cp2, tail_cp2 = run_distributed(_cp_logits_then_train, 2, str(tmp_path / "a"), ["parallel.cp=2"], ids)[0]
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000003", tmp_path / "b" / "checkpoints" / "step_00000003")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_00000003\n")
    logits_cp1, tail_cp1 = run_distributed(_cp_logits_then_train, 1, str(tmp_path / "b"), [], ids)[0]
    torch.testing.assert_close(logits_cp1, logits_cp2, rtol=0, atol=1e-5)
    assert len(tail_cp1) == 2
    torch.testing.assert_close(torch.tensor(tail_cp1), torch.tensor(tail_cp2), rtol=1e-5, atol=0)
