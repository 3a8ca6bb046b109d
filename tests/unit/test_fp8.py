"""FP8 without a GPU: scale/amax bookkeeping, casts, the native FP8 linear's numerics (torch._scaled_mm runs
per-tensor on the CPU; row-wise is emulated), layer selection, compile-friendliness and config errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.model.fp8 import (
    Fp8Runtime,
    apply_native_fp8,
    fp8_layer_indices,
    resolve_fp8_backend,
)
from mmtrain.model.fp8_native import (
    Fp8Linear,
    Fp8Matmul,
    refresh_weights_in_place,
    scaled_mm,
)
from mmtrain.model.fp8_scaling import (
    E4M3,
    E5M2,
    FP8_MAX,
    AmaxHistory,
    dequantize,
    fp8_dtypes,
    quantize,
    quantize_rowwise,
    rows_then_amax,
    scale_from_amax,
)
from mmtrain.models.llama.model import GPTModel

TINY = ["data.mock=true", "train.device=cuda", "train.precision=fp8", "model.num_layers=4", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.num_attention_heads=4"]


def _cfg(*extra: str) -> GPTRunConfig:
    return load_config(GPTRunConfig, None, [*TINY, *extra])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------------ scaling
def test_scale_from_amax_margin_and_degenerate_amax():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    s = scale_from_amax(amax, 448.0)
    assert s[0].item() == pytest.approx(224.0)
    assert s[1:].tolist() == [1.0, 1.0, 1.0]  # zero / inf / nan amax: neutral scale, never inf or nan
    assert scale_from_amax(torch.tensor(2.0), 448.0, margin=2).item() == pytest.approx(56.0)
    assert fp8_dtypes("hybrid") == (E4M3, E5M2) and fp8_dtypes("e4m3") == (E4M3, E4M3)


def test_quantize_clamps_instead_of_nan_and_round_trip_error_bounds():
    x = torch.randn(4096) * 3
    for dtype, bound in ((E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)):  # half an ulp of 3 / 2 mantissa bits
        s = scale_from_amax(x.abs().max(), FP8_MAX[dtype])
        back = dequantize(quantize(x, s, dtype), 1 / s)
        normal = x.abs() * s > 2.0 ** -6 * 4  # away from the subnormal range
        err = ((back - x).abs() / x.abs())[normal]
        assert err.max().item() <= bound + 1e-6
    big = quantize(torch.tensor([1e6, -1e6]), torch.tensor(1.0), E4M3).float()
    assert big.tolist() == [448.0, -448.0]


def test_rowwise_quantize_scales_each_row():
    x = torch.randn(8, 32) * torch.logspace(-3, 3, 8)[:, None]
    q, inv = quantize_rowwise(x, -1, E4M3)
    assert inv.shape == (8, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((8,), 448.0))
    assert rel(dequantize(q, inv), x) < 0.05


class _Bufs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scales, self.amax_x, self.amax_g = torch.zeros(2), torch.zeros(1), torch.zeros(1)


def test_amax_history_ring_max_and_most_recent():
    for algo in ("max", "most_recent"):
        m = _Bufs()
        h = AmaxHistory([m], history_len=3, algo=algo, margin=0, fwd_dtype=E4M3, grad_dtype=E5M2)
        seen = []
        for step, (ax, ag) in enumerate([(4.0, 1e-3), (1.0, 2e-3), (2.0, 5e-4), (0.5, 1e-4), (0.25, 1e-4)]):
            m.amax_x.fill_(ax)
            m.amax_g.fill_(ag)
            h.update()
            seen.append((ax, ag))
            window = seen[-3:]  # the ring keeps 3 steps
            want_x = max(a for a, _ in window) if algo == "max" else ax
            want_g = max(g for _, g in window) if algo == "max" else ag
            assert m.scales[0].item() == pytest.approx(448.0 / want_x), (algo, step)
            assert m.scales[1].item() == pytest.approx(57344.0 / want_g, rel=1e-5), (algo, step)
            assert m.amax_x.item() == 0.0 and m.amax_g.item() == 0.0  # the next step starts afresh
    fresh = _Bufs()
    AmaxHistory([fresh], 4, "max", 0, E4M3, E5M2).update()
    assert fresh.scales.tolist() == [1.0, 1.0] and fresh.delayed_ready  # never seen non-zero: neutral scale


def test_amax_history_restore_continues_exactly_and_resizes():
    """What a checkpoint holds (``rows``: the ring unrolled, oldest first; the scales) restores the exact state;
    another history length keeps the newest steps and recomputes the scales from them."""
    amaxes = [(4.0, 1e-3), (1.0, 2e-3), (2.0, 5e-4), (0.5, 1e-4), (0.25, 3e-4), (8.0, 1e-5), (0.1, 1e-2)]
    saved, saved_h = _Bufs(), AmaxHistory([_Bufs()], 3, "max", 0, E4M3, E5M2)
    saved_h.matmuls = [saved]
    for ax, ag in amaxes[:4]:
        saved.amax_x.fill_(ax)
        saved.amax_g.fill_(ag)
        saved_h.update()
    (row,) = saved_h.rows()
    assert torch.equal(row, torch.tensor([[1.0, 2.0, 0.5], [2e-3, 5e-4, 1e-4]]))  # steps 2-4, oldest first
    resumed = _Bufs()
    h = AmaxHistory([resumed], 3, "max", 0, E4M3, E5M2)
    assert h.restore({0: (row.clone(), saved.scales.clone())}) == [] and resumed.delayed_ready
    assert torch.equal(resumed.scales, saved.scales)
    for ax, ag in amaxes[4:]:  # both continue: the same scales and histories, bit for bit
        for m, hist in ((saved, saved_h), (resumed, h)):
            m.amax_x.fill_(ax)
            m.amax_g.fill_(ag)
            hist.update()
        assert torch.equal(resumed.scales, saved.scales) and torch.equal(h.rows()[0], saved_h.rows()[0])
    (row,) = saved_h.rows()  # steps 5, 6, 7
    for length, algo, kept in ((5, "max", 3), (2, "max", 2), (2, "most_recent", 2)):
        m = _Bufs()
        h = AmaxHistory([m], length, algo, 0, E4M3, E5M2)
        assert h.restore({0: (row, torch.ones(2))}) == [0]
        assert torch.equal(h.rows()[0][:, length - kept:], row[:, 3 - kept:])
        assert not h.rows()[0][:, :length - kept].any()  # padded with zeros (older than anything seen)
        want = row[:, 3 - kept:].amax(-1) if algo == "max" else row[:, -1]
        assert m.scales.tolist() == pytest.approx((torch.tensor([448.0, 57344.0]) / want).tolist())


def test_runtime_saves_and_restores_delayed_state_by_matmul_name():
    import logging

    cfg = _cfg("model.vocab_size=64", "fp8.recipe=delayed", "fp8.output_layer=true")
    model = GPTModel(cfg.model)
    apply_native_fp8(model, cfg)
    rt = Fp8Runtime("native", cfg, [model])
    assert rt.names[:4] == ["layers.0.attn.qkv", "layers.0.attn.proj", "layers.0.mlp.up", "layers.0.mlp.down"]
    assert rt.names[-1] == "head" and len(rt.names) == 17 and rt.delayed_state() == {}  # nothing before a step
    for i, m in enumerate(rt.matmuls):
        m.amax_x.fill_(i + 1.0)
        m.amax_g.fill_(1.0 / (i + 1))
    rt.after_backward([])
    state = rt.delayed_state()
    assert list(state) == rt.names and state["head"]["amax_history"][:, -1].tolist() == pytest.approx(
        [17.0, 1.0 / 17])
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append((r.levelno, r.getMessage()))
    log = logging.getLogger("mmtrain.checkpoint")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        other = _cfg("model.vocab_size=64", "fp8.recipe=delayed", "fp8.output_layer=true", "fp8.bf16_first_layers=1",
                     "fp8.amax_history_len=8")
        model2 = GPTModel(other.model)
        apply_native_fp8(model2, other)
        rt2 = Fp8Runtime("native", other, [model2])
        without_layer_1 = {n: v for n, v in state.items() if not n.startswith("layers.1.")}
        rt2.load_delayed_state(without_layer_1, "ckpt", saved_any=True)
        for name, m in zip(rt2.names, rt2.matmuls):
            assert m.delayed_ready == (not name.startswith("layers.1.")), name
            if m.delayed_ready:  # history 1024 -> 8: scales recomputed from the same (only) step, same values
                assert torch.equal(m.scales, state[name]["scales"]), name
        warnings = [msg for level, msg in lines if level == logging.WARNING]
        assert any("no delayed-scaling state for 4 of this rank's 13 FP8 matmuls (layers.1.attn.qkv" in w
                   for w in warnings)
        assert any("length 1024, fp8.amax_history_len is 8" in w for w in warnings)
        lines.clear()
        fresh = Fp8Runtime("native", other, [model2])
        fresh.load_delayed_state({}, "bf16ckpt", saved_any=False)
        assert len(lines) == 1 and lines[0][0] == logging.INFO
        assert lines[0][1].startswith("fp8: bf16ckpt holds no delayed-scaling state (a BF16 checkpoint")
        assert lines[0][1].endswith("the amax history starts afresh")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# ------------------------------------------------------------------------------------------ the linear
def test_scaled_mm_emulation_matches_cpu_scaled_mm():
    a = torch.randn(32, 64).to(E4M3)
    b = torch.randn(48, 64).to(E4M3).t()
    sa, sb = torch.tensor([0.5]), torch.tensor([0.25])
    real = scaled_mm(a, b, sa, sb, torch.float32)
    emulated = (a.float() * sa) @ (b.float() * sb)
    assert torch.allclose(real, emulated, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe,fmt,bound", [("tensorwise", "hybrid", 0.09), ("delayed", "hybrid", 0.09),
                                              ("tensorwise", "e4m3", 0.06), ("rowwise", "e4m3", 0.06)])
def test_fp8_linear_forward_and_grads_close_to_fp32(recipe, fmt, bound):
    torch.manual_seed(0)
    ref = nn.Linear(64, 48, bias=True)
    fp8 = Fp8Linear(ref, recipe, fmt)
    x = torch.randn(2, 32, 64, requires_grad=True)
    g = torch.randn(2, 32, 48)
    y = fp8(x)
    y.backward(g)
    dx, dw, db = x.grad.clone(), ref.weight.grad.clone(), ref.bias.grad.clone()
    x.grad = ref.weight.grad = ref.bias.grad = None
    ref(x).backward(g)
    assert rel(y, ref(x)) < 0.05  # forward in E4M3 (3 mantissa bits)
    assert rel(dx, x.grad) < bound and rel(dw, ref.weight.grad) < bound  # gradients in E5M2 for hybrid
    assert torch.allclose(db, ref.bias.grad)
    assert fp8.weight is ref.weight and [n for n, _ in fp8.named_parameters()] == ["weight", "bias"]


def test_fast_accum_backward_option_reaches_every_matmul_and_keeps_grads_close():
    cfg = _cfg("fp8.recipe=delayed", "fp8.fast_accum_backward=true")
    matmuls = apply_native_fp8(GPTModel(cfg.model), cfg)
    assert matmuls and all(m.fast_accum_backward for m in matmuls)
    torch.manual_seed(0)
    ref = nn.Linear(64, 48, bias=False)
    lin = Fp8Linear(ref, "tensorwise", "hybrid", fast_accum_backward=True)
    x = torch.randn(32, 64, requires_grad=True)
    g = torch.randn(32, 48)
    lin(x).backward(g)
    dx, dw = x.grad.clone(), ref.weight.grad.clone()
    x.grad = ref.weight.grad = None
    ref(x).backward(g)
    assert rel(dx, x.grad) < 0.09 and rel(dw, ref.weight.grad) < 0.09


def test_rows_then_amax_equals_the_tensor_amax():
    x = torch.randn(16, 48, dtype=torch.bfloat16) * torch.logspace(-2, 2, 16)[:, None].to(torch.bfloat16)
    assert rows_then_amax(x).dtype == torch.float32
    assert rows_then_amax(x).item() == x.float().abs().max().item()


def test_delayed_records_amaxes_and_uses_the_scales():
    torch.manual_seed(0)
    lin = Fp8Linear(nn.Linear(32, 16, bias=False), "delayed", "hybrid")
    x = torch.randn(16, 32, requires_grad=True)
    lin(x).backward(torch.full((16, 16), 0.5))
    m = lin.matmul
    assert m.amax_x.item() == pytest.approx(x.abs().max().item())
    assert m.amax_g.item() == pytest.approx(0.5)
    AmaxHistory([m], 8, "max", 0, E4M3, E5M2).update()
    assert m.scales.tolist() == pytest.approx([448.0 / x.abs().max().item(), 57344.0 / 0.5])
    assert m.delayed_ready
    m.scales.fill_(1.0)  # a deliberately bad delayed scale clamps inputs beyond 448: the scales really are used
    with torch.no_grad():
        assert rel(lin(x * 1000), nn.functional.linear(x * 1000, lin.weight)) > 0.3


def test_weight_copies_are_cached_until_marked_stale():
    lin = Fp8Linear(nn.Linear(32, 16, bias=False), "tensorwise", "hybrid")
    x = torch.randn(4, 32)
    y0 = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert torch.equal(lin(x), y0)  # still the cached cast
    lin.matmul.weight_stale = True
    assert rel(lin(x), 2 * y0) < 1e-6


def test_compiles_without_graph_breaks():
    """Dynamo + AOTAutograd (the aot_eager backend: no C++ codegen on this CPU) trace the FP8 linear in one
    graph, including delayed scaling's in-place amax updates in forward and backward."""
    for recipe in ("delayed",):  # tensorwise runs the same function without the amax updates
        torch._dynamo.reset()
        lin = Fp8Linear(nn.Linear(32, 16, bias=False), recipe, "hybrid")
        torch.compile(lin, backend="aot_eager")(torch.randn(8, 32))  # stale weight: re-cast outside the graph
        assert not lin.matmul.weight_stale
        compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
        x = torch.randn(8, 32, requires_grad=True)
        x2 = torch.randn(8, 32, requires_grad=True)
        y, y2 = compiled(x), compiled(x2)  # two micro-batches in flight, as in a pipeline schedule
        (3 * y.sum()).backward()
        y2.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        if recipe == "delayed":
            assert lin.matmul.amax_x.item() == pytest.approx(torch.cat([x, x2]).abs().max().item())
            assert lin.matmul.amax_g.item() == pytest.approx(3.0)  # max over both backwards


def test_weight_copies_viewing_one_buffer_compile_once_and_stay_live():
    """fp8.param_gather makes the matmuls' W copies slices of one gathered buffer: a compiled graph takes these
    aliasing buffers without graph breaks or recompiles, and reads what the next gather writes into them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    seq = nn.Sequential(Fp8Linear(nn.Linear(32, 64, bias=False), "tensorwise", "hybrid"),
                        Fp8Linear(nn.Linear(64, 32, bias=False), "tensorwise", "hybrid"))
    flat = torch.zeros(2 * 32 * 64, dtype=torch.uint8)
    for i, lin in enumerate(seq):
        lin.matmul.w_a = flat[i * 2048:(i + 1) * 2048].view(E4M3).view(lin.weight.shape)
        lin.matmul.refresh_weight(lin.weight)  # casts into the views
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 32)
    assert torch.equal(compiled(x), seq(x))
    with torch.no_grad():
        for lin in seq:
            lin.weight.mul_(-2.0)
            lin.matmul.refresh_weight(lin.weight)  # in place, as the gather writes the buffer
    assert torch.equal(compiled(x), seq(x))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


# ------------------------------------------------------------------------------------------ the model
def test_layer_selection_and_names_unchanged():
    cfg = _cfg("fp8.bf16_first_layers=1", "fp8.bf16_last_layers=1")
    assert fp8_layer_indices(cfg) == {1, 2}
    model = GPTModel(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    matmuls = apply_native_fp8(model, cfg)
    assert len(matmuls) == 8  # 2 blocks x (qkv, proj, up, down)
    for i, block in model.layers.items():
        kinds = {type(block.attn.qkv), type(block.attn.proj), type(block.mlp.up), type(block.mlp.down)}
        assert kinds == ({Fp8Linear} if i in ("1", "2") else {nn.Linear}), i
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert model.layers["1"].attn.qkv.part_sizes == (64, 64, 64)


def test_runtime_recasts_every_forward_until_the_loop_takes_over():
    torch.manual_seed(0)
    cfg = _cfg("model.vocab_size=64")
    model = GPTModel(cfg.model)
    model.init_weights(1)
    apply_native_fp8(model, cfg)
    rt = Fp8Runtime("native", cfg, [model])
    ids = torch.randint(0, 64, (2, 16))
    out = model(ids)
    assert all(not m.weight_stale for m in rt.matmuls) and torch.isfinite(out).all()
    rt.weights_changed()
    assert all(m.weight_stale for m in rt.matmuls)
    model(ids)
    assert all(not m.weight_stale for m in rt.matmuls)
    assert "backend native, recipe tensorwise, format hybrid" in rt.describe()


@pytest.mark.parametrize("tied", [False, True])
def test_output_layer_in_fp8(tied):
    """``fp8.output_layer``: the head's GEMMs in FP8 (one more matmul, same parameter names), its weight the
    output weight (the embedding when tied), losses and gradients close to the BF16 head's."""
    torch.manual_seed(0)
    cfg = _cfg("model.vocab_size=64", "fp8.output_layer=true", f"model.tie_embeddings={str(tied).lower()}")
    ref = GPTModel(cfg.model)
    ref.init_weights(1)
    model = GPTModel(cfg.model)
    model.load_state_dict(ref.state_dict())
    keys = list(model.state_dict())
    matmuls = apply_native_fp8(model, cfg)
    assert len(matmuls) == 4 * 4 + 1 and matmuls[-1] is model.head_matmul
    assert model.head_matmul.weight_ref is model.output_weight()
    assert list(model.state_dict()) == keys
    rt = Fp8Runtime("native", cfg, [model])
    assert "in FP8 (qkv, proj, MLP) and the output layer" in rt.describe() and rt.matmuls[-1] is model.head_matmul
    ids = torch.randint(0, 64, (2, 17))
    losses = [m(ids[:, :-1], ids[:, 1:]).mean() for m in (ref, model)]
    for loss in losses:
        loss.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=0.02)
    assert rel(model.output_weight().grad, ref.output_weight().grad) < 0.1
    assert model.head_matmul.w_a.dtype == E4M3  # the head really ran through the FP8 matmul
    no_head = _cfg("model.vocab_size=64")
    plain = GPTModel(no_head.model)
    apply_native_fp8(plain, no_head)
    assert plain.head_matmul is None and "norms and the output layer in BF16" in Fp8Runtime("native", no_head,
                                                                                           [plain]).describe()


def test_fp8_head_and_loss_compile_in_one_graph():
    """The build compiles ``head_loss`` (FP8 head + cross-entropy) so the logits-gradient cast fuses with the
    loss backward: it traces without graph breaks, delayed scaling's amax updates included."""
    torch._dynamo.reset()
    cfg = _cfg("model.vocab_size=64", "fp8.output_layer=true", "fp8.recipe=delayed")
    model = GPTModel(cfg.model)
    model.init_weights(1)
    apply_native_fp8(model, cfg)
    Fp8Runtime("native", cfg, [model]).refresh([model.head_matmul])
    compiled = torch.compile(model.head_loss, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 64, requires_grad=True)
    labels = torch.randint(0, 64, (2, 16))
    compiled(x, labels).sum().backward()
    assert torch.isfinite(x.grad).all() and model.head_matmul.amax_g.item() > 0
    assert model.head_matmul.amax_x.item() == pytest.approx(x.abs().max().item())


def test_weights_recast_in_place_all_at_once_equal_the_per_weight_cast():
    torch.manual_seed(0)
    cfg = _cfg("model.vocab_size=64")
    model = GPTModel(cfg.model)
    model.init_weights(1)
    matmuls = apply_native_fp8(model, cfg)
    assert not refresh_weights_in_place(matmuls, torch.ones(len(matmuls)))  # buffers not sized yet: no-op
    for m in matmuls:
        m.refresh_weight(m.weight_ref)
    storages = [m.w_a.data_ptr() for m in matmuls]
    with torch.no_grad():
        for m in matmuls:
            m.weight_ref.mul_(1.5)
    want = []
    for m in matmuls:
        fresh = Fp8Matmul("tensorwise", "hybrid")
        fresh.refresh_weight(m.weight_ref)
        want.append(fresh)
    amax = torch.stack([m.weight_ref.detach().abs().amax().float() for m in matmuls])
    for m in matmuls:
        m.weight_stale = True
    assert refresh_weights_in_place(matmuls, amax)
    for m, w in zip(matmuls, want):
        for name in ("w_a", "w_b", "w_a_inv", "w_b_inv"):
            assert torch.equal(getattr(m, name).float(), getattr(w, name).float()), name
        assert not m.weight_stale
    assert [m.w_a.data_ptr() for m in matmuls] == storages  # same storage: compiled graphs keep their inputs


# ------------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("extra,match", [
    (["fp8.backend=native", "fp8.recipe=mxfp8"], "fp8.recipe=mxfp8 is not offered by fp8.backend=native"),
    (["fp8.backend=te", "fp8.recipe=rowwise", "fp8.format=e4m3"], "fp8.recipe=rowwise is not offered by fp8.backend=te"),
    (["fp8.recipe=rowwise"], "set fp8.format=e4m3"),
    (["fp8.amax_history_len=0"], "fp8.amax_history_len"),
    (["fp8.bf16_first_layers=2", "fp8.bf16_last_layers=2"], "leave no FP8 layer"),
    (["fp8.param_gather=true", "fp8.backend=te"], "fp8.param_gather=true needs fp8.backend=native"),
    (["fp8.param_gather=true", "fp8.recipe=rowwise", "fp8.format=e4m3"], "fp8.param_gather=true .* fp8.recipe=rowwise"),
    (["fp8.param_gather=true", "parallel.distributed_optimizer=false"], "parallel.distributed_optimizer=true"),
    (["fp8.backend=te", "fp8.fast_accum_backward=true"], "fp8.fast_accum_backward=true applies to the native"),
    (["fp8.recipe=rowwise", "fp8.format=e4m3", "fp8.fast_accum_backward=true"], "fp8.fast_accum_backward"),
    (["fp8.backend=te", "fp8.output_layer=true"], "fp8.output_layer=true is a native-backend option"),
    (["train.device=cpu"], "train.precision=fp8 needs a Hopper/Blackwell GPU"),
])
def test_config_errors_name_the_keys(extra, match):
    with pytest.raises(ConfigError, match=match):
        validate_gpt_config(_cfg(*extra))


def test_param_gather_config_is_accepted_native_and_refused_when_auto_picks_te(monkeypatch):
    validate_gpt_config(_cfg("fp8.param_gather=true", "fp8.backend=native", "fp8.recipe=delayed"))
    from mmtrain.model import fp8

    monkeypatch.setattr(fp8, "te_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    with pytest.raises(ConfigError, match="fp8.param_gather=true is a native-backend option, but fp8.backend=auto"):
        resolve_fp8_backend(_cfg("fp8.param_gather=true"), torch.device("cuda"))
    assert resolve_fp8_backend(_cfg("fp8.param_gather=true", "fp8.backend=native"), torch.device("cuda")) == "native"


@pytest.mark.parametrize("tied", [False, True])
def test_param_gather_weights(tied):
    """Which weights go to FP8-gathered buckets: the FP8 linears' (and an untied FP8 output layer's), never the
    embedding (a tied FP8 head's weight); with one data-parallel rank none, and the log line says it is a no-op."""
    from mmtrain.model.fp8_param_gather import gather_weights

    cfg = _cfg("model.vocab_size=64", "fp8.output_layer=true", f"model.tie_embeddings={str(tied).lower()}",
               "fp8.param_gather=true")
    model = GPTModel(cfg.model)
    apply_native_fp8(model, cfg)
    rt = Fp8Runtime("native", cfg, [model])
    chosen = {id(p) for p in gather_weights(rt, cfg, 2)}
    linears = [m for m in rt.matmuls if m is not model.head_matmul]
    assert len(linears) == 16 and all(id(m.weight_ref) in chosen for m in linears)
    assert (id(model.output_weight()) in chosen) is not tied and id(model.embed.weight) not in chosen
    assert gather_weights(rt, cfg, 1) == [] and "fp8.param_gather is a no-op" in rt.describe()


def test_fp8_on_the_cpu_is_a_config_error_at_start_up():
    with pytest.raises(ConfigError, match="train.precision=fp8 needs an FP8 GPU"):
        resolve_fp8_backend(_cfg(), torch.device("cpu"))


def test_native_matmul_rejects_te_only_recipes():
    with pytest.raises(ValueError, match="native fp8 recipe"):
        Fp8Matmul("mxfp8")


def test_compiled_weight_casts_belong_to_their_model_not_to_a_module_global():
    import mmtrain.model.fp8_native as native
    import mmtrain.model.fp8_param_gather as gather

    cfg = _cfg("model.vocab_size=64", "fp8.output_layer=true")
    first, second = (apply_native_fp8(GPTModel(cfg.model), cfg) for _ in range(2))
    assert len({id(m.casts) for m in first}) == 1 and len({id(m.casts) for m in second}) == 1
    assert first[0].casts is not second[0].casts  # each model owns its compiled casts
    for module in (native, gather):  # and no module keeps compiled functions of its own
        assert not [name for name, value in vars(module).items() if name.startswith("_compiled")], module.__name__
