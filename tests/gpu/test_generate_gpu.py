"""Generation on the GPU: the compiled decode step (CUDA graphs) gives the eager step's tokens, in fp32 and bf16,
for a batch whose rows join and finish at different steps; Llama and DeepSeek-V3 (latent cache, MoE routing).

Fused kernels round differently from eager ones, and a tiny random model has near-ties between its top logits,
so a row may take another token where its two best candidates are within rounding of each other (seen on the
H200 in bf16, where the logits come out of a bf16 matmul and often tie exactly): then the rows must agree up to
that step and the eager model's logits there must show the two tokens within a few roundings of each other.
In a mixture of experts a near-tie of the router does the same: rounding sends a token to another expert, and
the logits then differ by more than rounding. So a DeepSeek-V3 row may also part where, at that step, some
layer's expert (or expert group) choice is within a few roundings of the next candidate. Any other difference
is a bug in the compiled path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmtrain.config.schema import ModelConfig
from mmtrain.inference.decode_linears import use_decode_kernels
from mmtrain.inference.decoder import decoder_forward, kv_cache_for
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.loading import prepare_for_decoding
from mmtrain.inference.sampling import SamplingParams
from mmtrain.model.mlp import MLP
from mmtrain.models.deepseek_v3.model import GroupLimitedRouter
from tests.inference_helpers import tiny_config, tiny_deepseek_config, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [3], [9, 9, 9]]
# |logit gap| / max |logit| that counts as a tie: a few roundings of the dtype (bf16 keeps 8 significant bits)
TIE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _margin(top: torch.Tensor, k: int) -> float:
    """How far the k-th best of ``top`` (descending) is from the (k+1)-th, relative to the largest |value|."""
    return float((top[k - 1] - top[k]) / top.abs().max())


def _router_margin(router: GroupLimitedRouter, x_D: torch.Tensor) -> float:
    """The smallest relative gap of the router's choices for one token: between the last chosen expert group and
    the next, and between the last chosen expert and the next allowed one (the selection of ``forward``)."""
    c = router.cfg
    choice = F.linear(x_D.float(), router.weight.float()).sigmoid() + router.expert_bias
    margins = []
    if c.n_group > 1:
        grouped = choice.view(c.n_group, -1)
        sums = grouped.topk(2, dim=-1).values.sum(-1)
        if c.topk_group < c.n_group:
            margins.append(_margin(sums.sort(descending=True).values, c.topk_group))
        choice = grouped[sums.topk(c.topk_group).indices].flatten()
    if c.num_experts_per_tok < choice.numel():
        margins.append(_margin(choice.sort(descending=True).values, c.num_experts_per_tok))
    return min(margins, default=float("inf"))


@torch.no_grad()
def _tied(model, ids: list[int], a: int, b: int, tol: float) -> tuple[bool, str]:
    """Whether the eager model at the end of ``ids`` has tokens ``a`` and ``b`` (or a routing choice) within
    ``tol``, and the gaps it saw."""
    routers = [m for m in model.modules() if isinstance(m, GroupLimitedRouter)]
    inputs = []
    hooks = [r.register_forward_pre_hook(lambda _m, args: inputs.append(args[0][-1])) for r in routers]
    cache = kv_cache_for(model, 1, len(ids), model.embed.weight.dtype, "cuda")
    tokens = torch.tensor([ids], device="cuda")
    logits = decoder_forward(model, cache, torch.arange(len(ids), device="cuda")[None], tokens_BS=tokens)[0]
    for h in hooks:
        h.remove()
    gap = float((logits[a] - logits[b]).abs() / logits.abs().max())
    route = min((_router_margin(r, x) for r, x in zip(routers, inputs)), default=float("inf"))
    return min(gap, route) <= tol, f"{gap:.2e} apart in the logits, {route:.2e} at the closest routing choice"


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_equals_eager(dtype, family):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = tiny_config() if family == "llama" else tiny_deepseek_config()
    model = prepare_for_decoding(tiny_model(cfg), "cuda", dtype)
    params = [SamplingParams(max_new_tokens=8 + 5 * i) for i in range(len(PROMPTS))]
    eager = generate(DecodeEngine(model, 3, 64), PROMPTS, params)
    engine = DecodeEngine(model, 3, 64, compile=True)
    for _ in range(2):  # the second run replays the captured graphs
        compiled = generate(engine, PROMPTS, params)
        assert [len(s.token_ids) for s in compiled] == [len(s.token_ids) for s in eager]
        for row, (c, e) in enumerate(zip(compiled, eager)):
            if c.token_ids == e.token_ids:
                continue
            j = next(i for i, (x, y) in enumerate(zip(c.token_ids, e.token_ids)) if x != y)
            tied, gaps = _tied(model, PROMPTS[row] + e.token_ids[:j], c.token_ids[j], e.token_ids[j], TIE[dtype])
            assert tied, (f"row {row}: compiled {c.token_ids} vs eager {e.token_ids}: they part at step {j} "
                          f"where the eager model's two tokens are {gaps} (relative to the largest)")


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("shape", [(2048, 8192), (3072, 2048), (200, 1000)])
@torch.no_grad()
def test_decode_kernel_linears_equal_the_linear_on_the_gpu(rows, shape):
    """The few-token decode kernel (mmtrain.model.gemv through mmtrain.inference.decode_linears: split over K, a
    table config, a default one with a ragged last tile), eager, compiled and replayed from a CUDA graph, against
    F.linear in fp32; the SwiGLU MLP's gated kernel against the MLP's own forward. Rows past gemv.MAX_ROWS take
    cuBLAS."""
    torch.manual_seed(0)
    n, k = shape
    layer = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    plain = layer(x)
    assert use_decode_kernels(layer) == 1
    torch._dynamo.reset()  # each shape compiles its own static step, as the engine's (dynamic=False)
    graphed = torch.compile(layer, mode="reduce-overhead", dynamic=False)
    for y in (layer(x), torch.compile(layer, dynamic=False)(x), graphed(x), graphed(x)):
        assert y.shape == plain.shape and y.dtype == plain.dtype
        err, plain_err = float((y.float() - ref).abs().max()), float((plain.float() - ref).abs().max())
        assert err <= 2 * plain_err + 1e-3, (err, plain_err)
    cfg = ModelConfig(hidden_size=k, ffn_hidden_size=n, activation="swiglu")
    mlp = MLP(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    plain = mlp(x)
    assert use_decode_kernels(mlp) == 3
    for y in (mlp(x), torch.compile(mlp, dynamic=False)(x)):
        torch.testing.assert_close(y, plain, rtol=2e-2, atol=2e-2 * float(plain.abs().max()))


def test_sampled_step_is_queued_without_waiting_for_the_gpu():
    """A decode step of sampled rows (top-k and top-p too) is launched without a host sync (it overlaps the host's
    work on the previous step), and gives the tokens drawn in step."""
    model = tiny_model(tiny_config()).cuda()
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_k=[0, 20][i % 2], top_p=[0.9, 1.0][i % 2],
                             seed=i) for i in range(len(PROMPTS))]
    ref = generate(DecodeEngine(model, 3, 64, overlap=False), PROMPTS, params)
    engine = DecodeEngine(model, 3, 64, overlap=True)
    launch = engine._launch

    def checked(running):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(running)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine._launch = checked
    ahead = generate(engine, PROMPTS, params)
    assert [s.token_ids for s in ahead] == [s.token_ids for s in ref]
