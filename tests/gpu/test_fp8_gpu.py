"""FP8 on the GPU (skipped without CUDA or below sm_89): the native linear's real torch._scaled_mm numerics,
eager vs compiled, and short training runs per backend and recipe that track BF16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.model.fp8 import te_import_error
from mmtrain.model.fp8_native import Fp8Casts, Fp8Linear, refresh_weights_in_place
from mmtrain.model.fp8_scaling import quantize
from mmtrain.parallel import ParallelDims, init_distributed
from mmtrain.train.loop import train_gpt

BASE = ["data.mock=true", "data.seq_length=256", "train.device=cuda", "train.steps=8", "train.micro_batch_size=4",
        "checkpoint.save_final=false", "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512",
        "model.num_attention_heads=4", "model.vocab_size=1024", "optim.lr=1e-3"]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an FP8 GPU (sm_89+)")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe,fmt,fast_bwd", [("tensorwise", "hybrid", False), ("delayed", "hybrid", False),
                                                  ("rowwise", "e4m3", False), ("tensorwise", "hybrid", True),
                                                  ("delayed", "hybrid", True)])
@pytest.mark.parametrize("compiled", [False, True])
def test_native_linear_on_the_gpu(recipe, fmt, fast_bwd, compiled):
    torch.manual_seed(0)
    ref = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    lin = Fp8Linear(ref, recipe, fmt, fast_accum_backward=fast_bwd)
    run = torch.compile(lin) if compiled else lin
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    y = run(x)
    y.backward(g)
    dx, dw = x.grad.clone(), ref.weight.grad.clone()
    x.grad = ref.weight.grad = None
    y_ref = ref(x)
    y_ref.backward(g)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert rel(y, y_ref) < 0.06
    assert rel(dx, x.grad) < 0.1 and rel(dw, ref.weight.grad) < 0.1


def _cast_linears() -> tuple[list[Fp8Linear], list]:
    """Four tensorwise FP8 linears of different shapes on the GPU, their FP8 weight copies made once."""
    torch.manual_seed(0)
    casts = Fp8Casts()  # one model's compiled casts, as apply_native_fp8 shares them
    lins = [Fp8Linear(nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16), "tensorwise", "hybrid",
                      casts=casts)
            for i, o in ((256, 768), (256, 256), (256, 1024), (512, 256))]
    for lin in lins:
        object.__setattr__(lin.matmul, "weight_ref", lin.weight)
        lin.matmul.refresh_weight(lin.weight)
    return lins, [lin.matmul for lin in lins]


def test_weights_recast_in_place_on_the_gpu_equal_the_per_weight_cast():
    """The compiled all-weights cast (refresh_weights_in_place) against the per-weight one."""
    lins, matmuls = _cast_linears()
    with torch.no_grad():
        for lin in lins:
            lin.weight.mul_(3.0)
    amax = torch.stack([lin.weight.detach().abs().amax().float() for lin in lins])
    assert refresh_weights_in_place(matmuls, amax)
    for lin in lins:
        want = Fp8Linear(lin, "tensorwise", "hybrid").matmul
        want.refresh_weight(lin.weight)
        for name in ("w_a", "w_b", "w_a_inv", "w_b_inv"):
            assert torch.equal(getattr(lin.matmul, name).float(), getattr(want, name).float()), name


def test_fp8_param_gather_cast_of_pieces_equals_the_in_place_cast_on_the_gpu():
    """fp8.param_gather casts each rank's pieces of a weight (compiled) with the scale of the whole weight: the
    bytes must be those of the per-step cast of whole weights (refresh_weights_in_place), bit for bit."""
    from mmtrain.model.fp8_param_gather import cast_pieces

    lins, matmuls = _cast_linears()
    amax = torch.stack([lin.weight.detach().abs().amax().float() for lin in lins])
    assert refresh_weights_in_place(matmuls, amax)
    casts = matmuls[0].casts
    scales, inv = casts.weight_scales(amax, torch.float8_e4m3fn)
    flat = torch.cat([lin.weight.detach().reshape(-1) for lin in lins])  # like the parameter buffer
    plan, offset = [], 0
    for i, lin in enumerate(lins):  # two pieces per weight, cut where no row ends (like a shard boundary)
        n = lin.weight.numel()
        cut = offset + n // 3 + 5
        plan += [(offset, cut, i), (cut, offset + n, i)]
        offset += n
    outs = [torch.empty(hi - lo, dtype=torch.float8_e4m3fn, device="cuda") for lo, hi, _ in plan]
    cast_pieces(flat, scales, outs, tuple(plan), torch.float8_e4m3fn, casts)
    for i, m in enumerate(matmuls):
        got = torch.cat([outs[2 * i].view(torch.uint8), outs[2 * i + 1].view(torch.uint8)])
        assert torch.equal(got.view(m.w_a.shape), m.w_a.view(torch.uint8)), i
        assert torch.equal(inv[i].reshape(1), m.w_a_inv), i


@pytest.fixture(scope="module")
def mesh():
    init_distributed("nccl", torch.device("cuda", 0))
    return ParallelDims(world_size=1).build()


@pytest.fixture(scope="module")
def bf16_losses(mesh, tmp_path_factory):
    cfg = load_config(GPTRunConfig, None, [*BASE, "train.precision=bf16",
                                           f"logging.run_dir={tmp_path_factory.mktemp('bf16')}"])
    return train_gpt(cfg, mesh, torch.device("cuda", 0)).losses


VARIANTS = [["fp8.backend=native", "fp8.recipe=tensorwise"],
            ["fp8.backend=native", "fp8.recipe=delayed", "train.compile=true"],
            ["fp8.backend=native", "fp8.recipe=rowwise", "fp8.format=e4m3", "train.compile=true"],
            ["fp8.backend=native", "fp8.recipe=tensorwise", "fp8.bf16_first_layers=1"],
            ["fp8.backend=native", "fp8.recipe=delayed", "train.compile=true", "fp8.fast_accum_backward=true"],
            ["fp8.backend=te", "fp8.recipe=delayed"],
            ["fp8.backend=te", "fp8.recipe=tensorwise", "train.compile=true"],
            # packed documents through TE's linears (the attention core stays the block-mask FlexAttention)
            ["fp8.backend=te", "fp8.recipe=delayed", "train.compile=true", "data.reset_position_ids=true",
             "data.reset_attention_mask=true", "data.eod_mask_loss=true"]]


@pytest.mark.parametrize("extra", VARIANTS, ids=lambda e: "-".join(x.split("=")[1] for x in e))
def test_fp8_training_tracks_bf16(tmp_path, mesh, bf16_losses, extra):
    if "fp8.backend=te" in extra and (te_error := te_import_error()) is not None:
        pytest.skip(f"Transformer Engine does not import here: {te_error}")
    cfg = load_config(GPTRunConfig, None, [*BASE, "train.precision=fp8", f"logging.run_dir={tmp_path}", *extra])
    losses = train_gpt(cfg, mesh, torch.device("cuda", 0)).losses
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(abs(a - b) / b < 0.03 for a, b in zip(losses, bf16_losses)), (losses, bf16_losses)


def test_delayed_scaling_state_round_trips_through_a_checkpoint_on_the_gpu(tmp_path, mesh):
    """A compiled native delayed run saves at its last step; a run resuming from it (no steps left) holds the
    same amax histories and scales, bit for bit, on the GPU (the CPU tests check the continuation)."""
    run = [*BASE, "train.precision=fp8", "fp8.backend=native", "fp8.recipe=delayed", "fp8.amax_history_len=4",
           "fp8.output_layer=true", "train.compile=true", "train.steps=6", "checkpoint.save_final=true"]
    saved = train_gpt(load_config(GPTRunConfig, None, [*run, f"logging.run_dir={tmp_path}/a"]), mesh,
                      torch.device("cuda", 0)).model.fp8_runtime
    resumed = train_gpt(load_config(GPTRunConfig, None, [*run, f"logging.run_dir={tmp_path}/b",
                                                         f"checkpoint.load={tmp_path}/a/checkpoints"]), mesh,
                        torch.device("cuda", 0)).model.fp8_runtime
    want, got = saved.delayed_state(), resumed.delayed_state()
    assert list(got) == list(want) and len(want) == 2 * 4 + 1
    for name, state in want.items():
        for k, v in state.items():
            assert got[name][k].is_cuda and torch.equal(got[name][k], v), (name, k)
    assert all(m.delayed_ready for m in resumed.matmuls)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp_fp8_on_the_gpu_equals_fp8_without_fsdp(tmp_path, mesh, compiled):
    """parallel.fsdp with native FP8 on the real torch._scaled_mm (one GPU: FSDP over one rank still frees the
    blocks and gathers their FP8 weights per use, with the compiled casts): losses track the same FP8 run
    without FSDP, and the gathered FP8 copies equal casting the whole BF16 weights (the CPU proofs at DP2 x TP2
    are tests/distributed/test_fsdp_fp8.py; two GPUs: bench/h200x2_fsdp.sh)."""
    run = [*BASE, "train.precision=fp8", "fp8.backend=native", "fp8.recipe=delayed", "fp8.output_layer=true",
           "train.activation_checkpointing=selective", *(["train.compile=true"] if compiled else [])]
    plain = train_gpt(load_config(GPTRunConfig, None, [*run, f"logging.run_dir={tmp_path}/a"]), mesh,
                      torch.device("cuda", 0)).losses
    result = train_gpt(load_config(GPTRunConfig, None, [*run, "parallel.fsdp=true", f"logging.run_dir={tmp_path}/b"]),
                       mesh, torch.device("cuda", 0))
    assert all(abs(a - b) / b < 1e-3 for a, b in zip(result.losses, plain)), (result.losses, plain)
    gather = result.model.fp8_runtime.param_gather
    assert gather is not None and len(gather.matmuls) == 2 * 4 and gather.unit_gathers > 0
    # the run ended with the BF16 weights whole: the copies the BF16 path's in-place refresh would cast
    weights = [m.weight_ref.detach() for m in gather.matmuls]
    scales, inv = gather.casts.weight_scales(torch.stack([w.abs().amax().float() for w in weights]), gather.dtype)
    expected = {}
    for i, (m, w) in enumerate(zip(gather.matmuls, weights)):
        a = quantize(w, scales[i], gather.dtype)
        expected[id(m)] = (a, a.t().contiguous(), inv[i].reshape(1))
    for b in gather.buckets:  # the FP8 gather alone, as before a block's forward
        gather.owner._free(b)
        gather.owner._gather(b)
    for m in gather.matmuls:
        a, t, inv = expected[id(m)]
        assert torch.equal(m.w_a.view(torch.uint8), a.view(torch.uint8))
        assert torch.equal(m.w_b.view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(m.w_a_inv, inv)
