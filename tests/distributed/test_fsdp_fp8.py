"""parallel.fsdp with native FP8 (CPU, gloo, 4 ranks: DP2 x TP2 with sequence parallelism, FP8 emulated on the
CPU, delayed scaling, the FP8 output layer on): each block's FP8 weights are gathered in FP8 for every use; the
FP8 copies are bit for bit what casting the whole BF16 weights gives (weight amaxes reduced over DP and TP); the
blocks' BF16 storage of those weights stays unallocated while they compute; losses and gradient norms equal the
distributed optimizer's FP8 run; a checkpoint saved with it resumes exactly. Compiled blocks: FSDP with FP8 on
the GPU (tests/gpu/test_fp8_gpu.py, inductor) and FSDP across ranks on the CPU (test_fsdp_compile.py); the same
run here compiled (aot_eager, 4 ranks) was two thirds of this file's CPU time."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=64", "data.mock=true", "data.seq_length=16"]
RUN = [*MODEL, "train.device=cpu", "train.steps=2", "train.micro_batch_size=2", "train.global_batch_size=4",
       "optim.lr=3e-3", "optim.warmup_steps=1", "checkpoint.save_final=false", "parallel.dp=2", "parallel.tp=2",
       "parallel.sequence_parallel=true", "train.precision=fp8", "fp8.recipe=delayed", "fp8.output_layer=true"]
FP8_COPIES = ("w_a", "w_b", "w_a_inv", "w_b_inv")


def _expected_copies(m, tp_group) -> list[torch.Tensor]:
    """What the BF16 path's refresh casts from the whole weight (its amax reduced over TP)."""
    import torch.distributed as dist

    from mmtrain.model.fp8_scaling import tensor_amax

    w = m.weight_ref.detach()
    amax = tensor_amax(w).reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
    a, b, inv = m.casts.weight_pair(w, amax[0], m.fwd_dtype)
    return [a.float(), b.float(), inv.float(), inv.float()]


def _runs(rank: int, world_size: int, run_dir: str):
    from mmtrain.model import fp8  # the build imports resolve_fp8_backend from it when it runs
    from mmtrain.train.loop import train_gpt

    fp8.resolve_fp8_backend = lambda cfg, device: "native"  # the CPU stands in for the GPU (emulated FP8)
    out = {}
    saved = f"{run_dir}/fsdp/checkpoints/step_00000001"
    for name, extra in {"distopt": [], "fsdp": ["parallel.fsdp=true", "checkpoint.save_every=1"],
                        "resumed": ["parallel.fsdp=true", f"checkpoint.load={saved}"]}.items():
        cfg = load_config(GPTRunConfig, None, [*RUN, *extra, f"logging.run_dir={run_dir}/{name}"])
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
        result = train_gpt(cfg, mesh, torch.device("cpu"))
        model, gather = result.model, result.model.fp8_runtime.param_gather
        row = {"losses": result.losses, "grad_norms": result.grad_norms}
        if gather is not None and name != "resumed":
            # the run ended with the BF16 weights whole (gather_full_params): what the copies must be cast from
            expected = {id(m): _expected_copies(m, mesh.tp_group) for m in gather.matmuls}
            owner = gather.owner
            for b in gather.buckets:  # as FSDP does before a block's forward: the FP8 gather alone
                owner._free(b)
                owner._gather(b)
            row["equal_copies"] = all(torch.equal(getattr(m, k).float(), e)
                                      for m in gather.matmuls for k, e in zip(FP8_COPIES, expected[id(m)]))
            row["counts"] = (len(gather.matmuls), gather.shard_casts)
            for b in owner.units:
                owner._free(b)
            seen = []  # during one more forward/backward: (BF16 weight bytes, FP8 copy bytes) at each FP8 linear
            for m in gather.matmuls:
                m.register_forward_pre_hook(lambda mod, args: seen.append(
                    (args[1].untyped_storage().nbytes(), mod.w_a.untyped_storage().nbytes())))
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))  # same on TP ranks
            model(tokens, tokens).sum().backward()
            row["seen"] = seen
        out[name] = row
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_runs, 4, str(tmp_path_factory.mktemp("fsdp_fp8")))


def test_fsdp_fp8_copies_equal_casting_the_whole_bf16_weights(runs):
    for rank, out in enumerate(runs):
        for name in ("fsdp",):
            assert out[name]["equal_copies"], (rank, name)
            assert out[name]["counts"] == (8, 3)  # 2 blocks x 4 linears (the head is whole: re-cast); start + 2 steps


def test_fsdp_fp8_computes_without_the_bf16_weights(runs):
    for out in runs:
        seen = out["fsdp"]["seen"]
        assert len(seen) == 8 and all(bf16 == 0 and fp8 > 0 for bf16, fp8 in seen), seen


def test_fsdp_fp8_trains_like_the_distributed_optimizer(runs):
    for out in runs:
        ref = out["distopt"]
        for name in ("fsdp",):
            assert out[name]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
            assert out[name]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)


def test_fsdp_fp8_resumes_exactly(runs):
    """The save gathers the FP8 weights' BF16 values; the load casts the FP8 shards again from the loaded ones."""
    for out in runs:
        assert out["resumed"]["losses"] == pytest.approx(out["fsdp"]["losses"][1:], rel=1e-6)
