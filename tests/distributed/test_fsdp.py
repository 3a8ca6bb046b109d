"""parallel.fsdp (fully sharded data parallelism) trains exactly like one process (fp32, CPU, gloo): losses over
4 steps (1 of warmup: three full-rate updates compound a gradient difference, as in
test_gpt_parallel_equivalence.py) and the final parameters; composes with TP, PP and activation recompute;
checkpoints resume across the FSDP and distributed-optimizer layouts; a block's non-owned parameter storage is not
resident after a step; a unit's gradients, written together when it completes, equal the added ones (a parameter
that arrives twice, a unit left incomplete)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=8", "optim.warmup_steps=1", "optim.lr=3e-3",
        "model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64"]


def _cfg(run_dir: str, extra: list[str]) -> GPTRunConfig:
    return load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = _cfg(run_dir, extra)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("ref")), [])[0]


def _assert_equal(reference, results, extra, experts=False):
    """Losses to 1e-5 relative, every parameter (this TP rank's shard) to 2e-5 of its norm (the bar
    test_gpt_parallel_equivalence.py sets: fp32 reduction-order noise, while a sharding bug moves weights > 1e-3)."""
    ref_losses, ref_params = reference[0], reference[1]
    spec = llama_sharding_spec(_cfg("unused", extra).model)
    for losses, params, coord, tp in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name if name in ref_params else "embed.weight"], spec, coord[0], tp)
            if experts and spec[name].expert_dim is not None:  # this EP rank's slice of the experts
                expected = expected.narrow(spec[name].expert_dim, coord[4] * value.shape[spec[name].expert_dim],
                                           value.shape[spec[name].expert_dim])
            rel = (value - expected).norm() / expected.norm().clamp_min(1e-12)
            assert rel < 2e-5, f"{name}: relative difference {rel:.2e} (rank coord {coord})"


@pytest.mark.parametrize("world, extra", [
    (2, ["parallel.dp=2"]),
    (2, ["parallel.dp=2", "train.activation_checkpointing=full"]),
    (4, ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    (4, ["parallel.dp=2", "parallel.pp=2"]),
    (4, ["parallel.dp=2", "parallel.pp=2", "parallel.virtual_pp=2"]),
    (4, ["parallel.dp=2", "parallel.cp=2"]),
    (2, ["parallel.dp=2", "optim.master_weights=false"]),
], ids=["dp2", "dp2-recompute", "dp2-tp2-sp", "dp2-pp2", "dp2-pp2-vpp2", "dp2-cp2", "dp2-no-masters"])
def test_fsdp_equals_one_process(tmp_path, reference, world, extra):
    results = run_distributed(_train, world, str(tmp_path), [*extra, "parallel.fsdp=true"])
    _assert_equal(reference, results, [])


def test_fsdp_with_tied_embeddings_over_pipeline_stages_equals_one_process(tmp_path):
    """The tied embedding's copies (first/last stage) are summed before their reduction: the resident late bucket."""
    tied = ["model.tie_embeddings=true"]
    reference = run_distributed(_train, 1, str(tmp_path / "ref"), tied)[0]
    results = run_distributed(_train, 4, str(tmp_path / "fsdp"), ["parallel.dp=2", "parallel.pp=2",
                                                                  "parallel.fsdp=true", *tied])
    _assert_equal(reference, results, tied)


MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]


def test_fsdp_with_expert_parallelism_equals_one_process(tmp_path):
    """Experts are units of their own over the expert-data-parallel group (dp4 with ep2: edp2)."""
    reference = run_distributed(_train, 1, str(tmp_path / "ref"), MOE)[0]
    results = run_distributed(_train, 4, str(tmp_path / "fsdp"), ["parallel.dp=4", "parallel.ep=2",
                                                                  "parallel.fsdp=true", *MOE])
    _assert_equal(reference, results, MOE, experts=True)


def test_fsdp_with_the_shared_experts_backward_overlapped_equals_one_process(tmp_path):
    """The overlapped shared-expert backward (its own graph, run inside the combine exchange's backward) under
    FSDP's unshard/reduce-scatter hooks."""
    moe = [*MOE, "model.moe_shared_ffn_hidden_size=32"]
    reference = run_distributed(_train, 1, str(tmp_path / "ref"), moe)[0]
    layout = ["parallel.dp=4", "parallel.ep=2", "parallel.fsdp=true", "parallel.ep_overlap_shared=true"]
    results = run_distributed(_train, 4, str(tmp_path / "fsdp"), [*layout, *moe])
    _assert_equal(reference, results, moe, experts=True)


def _train_to(rank: int, world_size: int, run_dir: str, extra: list[str]):
    cfg = _cfg(run_dir, ["train.steps=5", "checkpoint.save_every=3", "checkpoint.keep_last=0", *extra])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


@pytest.mark.parametrize("saved, loaded", [
    (["parallel.fsdp=true"], []),
    ([], ["parallel.fsdp=true"]),
], ids=["fsdp-to-distopt", "distopt-to-fsdp"])
def test_resume_across_fsdp_and_distributed_optimizer(tmp_path, saved, loaded):
    """Saved at step 3 of 5 with one layout, resumed with the other: steps 4-5 match the unbroken run."""
    full = run_distributed(_train_to, 2, str(tmp_path / "a"), ["parallel.dp=2", *saved])[0]
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000003", tmp_path / "b" / "checkpoints" / "step_00000003")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_00000003\n")
    tail = run_distributed(_train_to, 2, str(tmp_path / "b"), ["parallel.dp=2", *loaded])[0]
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(full[3:]), rtol=1e-5, atol=0)


def _residency(rank: int, world_size: int):
    """Two blocks as units and a resident head over dp=world_size: what stays allocated after a step."""
    import torch.distributed as dist
    from torch import nn

    from mmtrain.parallel.fsdp import FsdpBuckets

    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(2)])
    head = nn.Linear(16, 1)
    group = dist.new_group(list(range(world_size)))
    units = [list(b.parameters()) for b in blocks]
    owner = FsdpBuckets(units, list(blocks), list(head.parameters()), group, torch.float32)
    seen_while_running = []
    blocks[1].register_forward_pre_hook(lambda m, a: seen_while_running.append(
        [b.full_param.untyped_storage().nbytes() for b in owner.units]))
    owner.reset()
    x = torch.randn(4, 16)
    for block in blocks:
        x = block(x)
    head(x).sum().backward()
    owner.finish(1.0)
    unit_elems = [b.end - b.start for b in owner.units]
    return ([b.full_param.untyped_storage().nbytes() for b in owner.units],
            [b.shard_param.numel() for b in owner.units], unit_elems, seen_while_running[0],
            owner.resident_param_bytes(), sum(p.numel() for p in head.parameters()))


def test_block_parameters_not_resident_after_a_step():
    """After forward, backward and the reduction, each block's full values are freed: a rank holds 1/dp of
    every block (its shard) plus the resident head; during block 1's forward, block 0 is already freed."""
    for freed, shard, elems, during, resident, head in run_distributed(_residency, 2):
        assert freed == [0, 0]
        assert shard == [n // 2 for n in elems]
        assert during[0] == 0 and during[1] == elems[1] * 4  # block 1 gathered (prefetched), block 0 freed
        head_padded = -(-head // 2) * 2
        assert resident == 4 * (sum(elems) // 2 + head_padded // 2 + head_padded)


def _frozen(rank: int, world_size: int):
    """A frozen model (as the DPO reference) sharded with trainable=False: forward equals the unsharded one."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from mmtrain.parallel.fsdp import FsdpBuckets

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]).requires_grad_(False)
    x = torch.randn(4, 16)
    want = copy.deepcopy(blocks)(x)
    owner = FsdpBuckets([list(b.parameters()) for b in blocks], list(blocks), [],
                        dist.new_group(list(range(world_size))), torch.float32, trainable=False)
    with torch.no_grad():
        got = blocks(x)
    return (torch.equal(got, want), [b.full_param.untyped_storage().nbytes() for b in owner.units],
            [b.shard_grad.numel() for b in owner.buckets], len(owner._hooks))


def test_frozen_model_sharded_without_gradients():
    for equal, freed, grads, hooks in run_distributed(_frozen, 2):
        assert equal and freed == [0, 0] and grads == [0, 0]
        assert hooks == 4  # the blocks' gather/free hooks only, no gradient hooks


def _partial_units(rank: int, world_size: int):
    """Two micro-batches through one unit of two linears, the first micro-batch reaching only the second linear
    (so the unit is complete in the second, with that linear's gradient arriving twice), then a micro-batch that
    reaches only the second linear (the unit left incomplete, reduced by ``finish``). Reduced shards gathered whole,
    with the unsharded gradients of the same micro-batches."""
    import torch.distributed as dist
    from torch import nn

    from mmtrain.parallel.fsdp import FsdpBuckets

    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 3)
    unit = nn.ModuleList([first, second])
    reference = [p.detach().clone().requires_grad_(True) for p in unit.parameters()]
    group = dist.new_group(list(range(world_size)))
    owner = FsdpBuckets([list(unit.parameters())], [unit], [], group, torch.float32)
    x = torch.randn(4, 8) + rank

    def run(micro_batches):
        owner.reset()
        for through_first in micro_batches:
            owner._pre_forward(owner.units, [])(unit, ())  # the unit's module hooks, as its forward would fire
            h = first(x) if through_first else x
            second(h).pow(2).sum().backward()
            rh = x @ reference[0].t() + reference[1] if through_first else x
            (rh @ reference[2].t() + reference[3]).pow(2).sum().backward()
        owner.finish(None)
        b = owner.units[0]
        whole = torch.empty(b.end - b.start)
        dist.all_gather_into_tensor(whole, b.shard_grad, group=group)
        want = torch.cat([(r.grad if r.grad is not None else torch.zeros_like(r)).reshape(-1) for r in reference])
        dist.all_reduce(want, group=group)
        for r in reference:
            r.grad = None
        return float((whole[:want.numel()] - want).abs().max()), float(whole[want.numel():].abs().sum())

    return run([False, True]), run([False])


def test_unit_gradients_written_together_equal_the_added_ones():
    for (err, pad), (err_incomplete, pad_incomplete) in run_distributed(_partial_units, 2):
        assert err < 1e-5 and pad == 0.0
        assert err_incomplete < 1e-5 and pad_incomplete == 0.0
