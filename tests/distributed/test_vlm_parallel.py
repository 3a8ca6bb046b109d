"""The VLM split over two ranks computes what one process computes: TP (ViT, audio encoder and LM sharded by the
GPT plan), TP + sequence parallelism, CP (media encoded on every rank, spliced, then zig-zag split) and PP
(encoders on the first stage, 1F1B over two micro-batches). Loss and every gradient, fp32 over gloo.

One spawn runs every layout (process start-up dominates on this machine); each rank compares against a whole
model it computes itself."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from mmtrain.config.schema import ParallelConfig, TrainConfig
from mmtrain.models.vlm import VLMModel
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.pipeline import PipelineComm, one_f_one_b
from mmtrain.parallel.tensor import allreduce_tp_partial_grads, tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.build_vlm import build_vlm_stage, vlm_forward_step
from tests.vlm_helpers import make_batch, tiny_vlm_config

SEED = 5
LAYOUTS = {"tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True}, "cp2": {"cp": 2}, "pp2": {"pp": 2}}


def _reference(batches):
    model = VLMModel(tiny_vlm_config())
    model.init_weights(SEED)
    total = sum(vlm_forward_step(model, b, None, _OneRank(), torch.device("cpu"))[0] for b in batches)
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()}


class _OneRank:  # the mesh fields vlm_forward_step reads, for the single-process reference
    dims = SimpleNamespace(cp=1)
    coord = SimpleNamespace(cp=0)


def _run_layout(rank: int, world_size: int, layout: str, batches, ref_loss, ref_grads) -> int:
    pc = ParallelConfig(**LAYOUTS[layout])
    cfg = SimpleNamespace(model=tiny_vlm_config(), parallel=pc, train=TrainConfig(seed=SEED, precision="fp32"))
    mesh = ParallelDims.from_config(pc, world_size).build()
    device = torch.device("cpu")
    stage = build_vlm_stage(cfg, mesh, device)
    loss = torch.zeros(())
    if mesh.dims.pp > 1:
        s, ranks = mesh.coord.pp, mesh.ranks("pp")
        comm = PipelineComm(mesh.pp_group, ranks[s - 1] if s > 0 else None, ranks[s + 1] if s < 1 else None,
                            (2, 32, cfg.model.language.hidden_size), torch.float32, device)

        def forward_step(i, received):
            out, total, _ = vlm_forward_step(stage, batches[i], received, mesh, device)
            if total is not None:
                loss.add_(total)
            return out

        one_f_one_b(forward_step, len(batches), comm, s, mesh.dims.pp)
    else:
        for b in batches:
            out, total, _ = vlm_forward_step(stage, b, None, mesh, device)
            out.backward()
            loss.add_(total)
    if mesh.dims.cp > 1:  # what the dp×cp reduction does: sum losses and gradients over the sequence pieces
        dist.all_reduce(loss, group=mesh.cp_group)
        for p in stage.parameters():
            dist.all_reduce(p.grad, group=mesh.cp_group)
    allreduce_tp_partial_grads(stage, mesh.tp_group)
    if stage.post_process:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"{layout}: loss")
    checked = 0
    r, n = mesh.coord.tp, mesh.dims.tp
    spec = stage.sharding_spec()
    for name, p in stage.named_parameters():
        assert p.grad is not None, f"{layout}: {name} has no gradient"
        expected = tp_shard_of(name, ref_grads[name], spec, r, n)  # also checks the VLM spec's names
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{layout}: gradient of {name}: {m}")
        checked += 1
    return checked


def _check_all_layouts(rank: int, world_size: int) -> dict[str, int]:
    batches = [make_batch(0), make_batch(1)]
    ref_loss, ref_grads = _reference(batches)
    return {layout: _run_layout(rank, world_size, layout, batches, ref_loss, ref_grads) for layout in LAYOUTS}


def test_vlm_tp_sp_cp_pp_match_one_process():
    results = run_distributed(_check_all_layouts, 2)
    n_params = len(list(VLMModel(tiny_vlm_config()).parameters()))
    for layout in ("tp2", "tp2-sp", "cp2"):  # every parameter on every rank
        assert results[0][layout] == results[1][layout] == n_params, layout
    assert results[0]["pp2"] + results[1]["pp2"] == n_params  # the stages hold the model between them
