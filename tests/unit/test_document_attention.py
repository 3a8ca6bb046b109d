"""Document-masked attention through FlexAttention block masks equals the dense-mask reference (fp32, CPU):
the kernel on its own (outputs and q/k/v gradients, also for the context-parallel query offsets), a GPT and a
DeepSeek-V3 model (loss and every parameter gradient), two pipeline stages, and the edge cases: documents of
one token, one document filling the sequence, no EOD at all. Compiled blocks take a new block mask per
micro-batch without recompiling.

FlexAttention refuses backward on CPU tensors in torch 2.11 (a device check in its Python entry point; the
eager implementation underneath is device-independent math). The fixture ``cpu_flex`` lifts that check for
these tests only, so the block masks and the flex code path are checked with gradients here; on the GPU the
same masks run in the fused kernel (tests/gpu/test_packed_attention_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.model.attention import (CausalAttention, DenseDocuments, FlexDocuments, dense_document_mask,
                                     document_block_mask)
from mmtrain.models.llama.model import GPTModel

E = 0  # the EOD token of these tests


def allow_cpu_flex_backward() -> None:
    """Lift FlexAttention's CPU-backward refusal (tests only; see the module docstring)."""
    flex_module._validate_device = lambda q, k, v: None


@pytest.fixture
def cpu_flex(monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: None)


def _docs_from_bounds(S: int, bounds: list[int]) -> torch.Tensor:
    ids = torch.zeros(S, dtype=torch.long)
    for b in bounds:
        ids[b:] += 1
    return ids


LAYOUTS = {
    "uneven": [5, 13, 14, 27, 40],
    "length_one": list(range(1, 48)),          # every token its own document
    "one_document": [],                        # one document fills the sequence
    "block_aligned": [8, 16, 40],
}


def _qkv(B, H, KV, Q, K, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, requires_grad=True) for h, n in ((H, Q), (KV, K), (KV, K))]


def _attend_and_grads(kernel, mask, q, k, v):
    out = kernel.attend(q, k, v, mask, None)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


def _block_map(num: torch.Tensor, indices: torch.Tensor, nk: int) -> torch.Tensor:
    """(B, nq, nk) bool of the key blocks a BlockMask lists per query block."""
    listed = torch.arange(nk)[None, None, None, :] < num[..., None]  # the first ``num`` entries count
    out = torch.zeros(*num.shape, nk, dtype=torch.bool)
    out.scatter_(-1, indices.long(), listed)  # listed entries are unique; unlisted ones write False
    return out[:, 0]


def _assert_blocks_match(mask, dense_BQK: torch.Tensor, block: int) -> None:
    """The block structure itself (the eager CPU kernel applies ``mask_mod`` everywhere, so equal outputs alone
    would not show a wrongly skipped or wrongly 'full' block): listed blocks are exactly those holding an attended
    key, and 'full' blocks attend every one of their keys."""
    B, Q, K = dense_BQK.shape
    nq, nk = -(-Q // block), -(-K // block)
    padded = torch.zeros(B, nq * block, nk * block, dtype=torch.int8)
    valid = torch.zeros_like(padded)
    padded[:, :Q, :K], valid[:, :Q, :K] = dense_BQK.to(torch.int8), 1
    blocks = padded.view(B, nq, block, nk, block).sum((2, 4))
    sizes = valid.view(B, nq, block, nk, block).sum((2, 4))
    partial = _block_map(mask.kv_num_blocks, mask.kv_indices, nk)
    full = _block_map(mask.full_kv_num_blocks, mask.full_kv_indices, nk)
    assert not (partial & full).any()
    assert torch.equal(partial | full, blocks > 0)
    assert torch.equal(full, (blocks == sizes) & (blocks > 0))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
# q_offset 16/32: a context-parallel chunk of queries against the keys up to its end
# (16, 20): lengths that are no multiple of the block (44 keys, 24 queries)
@pytest.mark.parametrize("block, q_offset", [(8, 0), (8, 16), (8, 32), (16, 0), (16, 32), (16, 20)])
def test_block_mask_equals_dense_reference(cpu_flex, layout, block, q_offset):
    S, Q = (48, 16 if q_offset else 48) if q_offset != 20 else (44, 24)
    ids = torch.stack([_docs_from_bounds(S, LAYOUTS[layout]), _docs_from_bounds(S, [3, 30])])
    kv_ids, q_ids = ids[:, :q_offset + Q], ids[:, q_offset:q_offset + Q]
    q, k, v = _qkv(2, 4, 2, Q, q_offset + Q, 8)
    flex_out, flex_grads = _attend_and_grads(FlexDocuments(block), FlexDocuments(block).mask(q_ids, kv_ids, q_offset),
                                             q, k, v)
    ref_out, ref_grads = _attend_and_grads(DenseDocuments(), dense_document_mask(q_ids, kv_ids, q_offset), q, k, v)
    _assert_blocks_match(document_block_mask(q_ids, kv_ids, q_offset, block),
                         dense_document_mask(q_ids, kv_ids, q_offset)[:, 0], block)
    torch.testing.assert_close(flex_out, ref_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(flex_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_block_mask_is_built_per_block_and_skips_blocks_across_documents():
    S, block = 64, 8
    ids = _docs_from_bounds(S, [16, 40])[None]
    mask = document_block_mask(ids, ids, 0, block)
    n = S // block
    assert mask.kv_num_blocks.shape == (1, 1, n) and mask.kv_indices.shape == (1, 1, n, n)  # (S/block)², not S²
    dense = dense_document_mask(ids, ids, 0)[0, 0].view(n, block, n, block).any(3).any(1)
    partial = mask.kv_num_blocks[0, 0]
    full = mask.full_kv_num_blocks[0, 0]
    assert torch.equal(partial + full, dense.sum(1).to(torch.int32))  # exactly the blocks holding attended keys
    assert full.sum() > 0 and full[0] == 0  # blocks inside one document below the diagonal skip the mask


def _cfg(*extra):
    return load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=64", "model.hidden_size=32",
                                            "model.ffn_hidden_size=64", "model.num_layers=2",
                                            "model.num_attention_heads=4", "model.num_query_groups=2", *extra]).model


def _packed_tokens(rows: list[list[int]], S: int, seed: int = 1) -> torch.Tensor:
    """(B, S + 1) random non-EOD tokens with EOD at the given input positions of each row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 64, (len(rows), S + 1), generator=g)
    for r, eods in enumerate(rows):
        tokens[r, eods] = E
    return tokens


EDGE_ROWS = {
    "uneven": [[4, 12, 13, 26], [7, 20]],
    "length_one": [list(range(0, 32)), list(range(0, 32, 2))],  # all EOD: every document one token long
    "no_eod": [[], []],                                         # one document fills each sequence
}


def _loss_and_grads(model, tokens):
    positions, doc_ids, loss_mask = packed_document_inputs(tokens, E, True, True, True)
    for p in model.parameters():
        p.grad = None
    losses = model(tokens[:, :-1], tokens[:, 1:], positions, doc_ids)
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("rows", sorted(EDGE_ROWS))
def test_gpt_flex_equals_dense_loss_and_every_gradient(cpu_flex, rows):
    cfg = _cfg()
    tokens = _packed_tokens(EDGE_ROWS[rows], 32)
    results = []
    for kernel in (FlexDocuments(block=8), DenseDocuments()):
        model = GPTModel(cfg, attention=CausalAttention(kernel))
        model.init_weights(5)
        results.append(_loss_and_grads(model, tokens))
    (flex_loss, flex_grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(flex_loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert flex_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(flex_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_pipeline_stages_with_flex_equal_the_whole_dense_model(cpu_flex):
    """PP2: each stage prepares its own block mask from the micro-batch's document ids."""
    cfg = _cfg("model.num_layers=4")
    tokens = _packed_tokens(EDGE_ROWS["uneven"], 32)
    positions, doc_ids, _ = packed_document_inputs(tokens, E, True, True, True)
    whole = GPTModel(cfg, attention=CausalAttention("dense"))
    first = GPTModel(cfg, (0, 2), True, False, attention=CausalAttention(FlexDocuments(8)))
    last = GPTModel(cfg, (2, 4), False, True, attention=CausalAttention(FlexDocuments(8)))
    for m in (whole, first, last):
        m.init_weights(2)
    ref = whole(tokens[:, :-1], tokens[:, 1:], positions, doc_ids)
    ref.sum().backward()
    hidden = first(tokens[:, :-1], None, positions, doc_ids)
    got = last(hidden, tokens[:, 1:], positions, doc_ids)
    got.sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for m in (first, last) for n, p in m.named_parameters()}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_deepseek_latent_attention_takes_the_same_strategy(cpu_flex):
    from mmtrain.models.deepseek_v3.shape_file import load_deepseek_v3_config
    from mmtrain.models.deepseek_v3.model import DeepseekV3Model

    cfg = load_deepseek_v3_config("configs/models/deepseek-v3-tiny.yaml", ["model.vocab_size=64"])
    assert cfg.v_head_dim != cfg.qk_head_dim  # the case SDPA and flex both take as it is
    tokens = _packed_tokens(EDGE_ROWS["uneven"], 32)
    results = []
    for kernel in (FlexDocuments(block=8), DenseDocuments()):
        model = DeepseekV3Model(cfg, attention=CausalAttention(kernel))
        model.init_weights(4)
        results.append(_loss_and_grads(model, tokens))
    (flex_loss, flex_grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(flex_loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(flex_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_blocks_take_new_document_boundaries_without_recompiling(cpu_flex):
    """The block mask is built in the model's forward (outside the compiled blocks) and flows in as data."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = GPTModel(_cfg(), attention=CausalAttention(FlexDocuments(block=8)))
    model.init_weights(0)
    for block in model.layers.values():
        block.compile(backend=counter, dynamic=False)
    frames = []
    for step, rows in enumerate([[[4, 12], [20]], [[1, 2, 3, 30], [9, 10]], [[], [15]], [[7], list(range(32))]]):
        tokens = _packed_tokens(rows, 32, seed=step)
        positions, doc_ids, _ = packed_document_inputs(tokens, E, True, True, True)
        model(tokens[:, :-1], tokens[:, 1:], positions, doc_ids).sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * len(frames), frames  # compiled once, then reused


def test_auto_kernel_is_flex_on_cuda_and_dense_on_cpu():
    attention = CausalAttention()
    assert attention.kernel_for(torch.device("cpu")).name == "dense"
    assert attention.kernel_for(torch.device("cuda")).name == "flex"
    assert attention.kernel_for(torch.device("cpu")) is attention.kernel_for(torch.device("cpu"))  # one object
    assert attention.prepare(None) is None  # no document ids: SDPA's causal kernel


def test_vlm_packing_flex_equals_dense_loss_and_every_gradient(cpu_flex):
    """``data.mm_pack``: row 0 of the batch packs two image-caption samples (two document ids)."""
    from mmtrain.models.vlm import VLMModel
    from tests.vlm_helpers import make_batch, tiny_vlm_config

    batch = make_batch()
    assert set(batch.document_ids[0].tolist()) == {-1, 0, 1}  # two samples, then padding (ids not sorted)
    results = []
    for kernel in (FlexDocuments(block=8), DenseDocuments()):
        model = VLMModel(tiny_vlm_config(), attention=CausalAttention(kernel))
        model.init_weights(3)
        losses = model(batch.tokens, batch.labels, batch.position_ids, batch.document_ids, images=batch.images,
                       image_counts=batch.image_counts, audio=batch.audio, audio_lengths=batch.audio_lengths,
                       audio_counts=batch.audio_counts, sample_keys=batch.__key__)
        losses.sum().backward()
        results.append((losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}))
    (flex_losses, flex_grads), (ref_losses, ref_grads) = results
    torch.testing.assert_close(flex_losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert flex_grads.keys() == ref_grads.keys() and any(n.startswith("vision.") for n in ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(flex_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_loader_hands_document_ids_with_each_micro_batch():
    """The train loop gets positions, document ids and the loss mask from the loader; it builds no mask."""
    from mmtrain.data.documents import DocumentRule, GPTMicroBatch
    from mmtrain.data.loader import MicroBatches

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "data.reset_attention_mask=true",
                                           "data.eod_mask_loss=true"])
    samples = [_packed_tokens([[3, 9]], 16, seed=i)[0] for i in range(4)]
    rule = DocumentRule.from_config(cfg.data, E)
    batch = MicroBatches(samples, 2, 0, 1, documents=rule).next()
    assert isinstance(batch, GPTMicroBatch)
    positions, doc_ids, loss_mask = packed_document_inputs(batch.tokens, E, False, True, True)
    assert torch.equal(batch.document_ids, doc_ids) and torch.equal(batch.loss_mask, loss_mask)
    assert torch.equal(batch.position_ids, positions)  # reset_position_ids is off: 0..S-1
    assert batch.document_ids[0].tolist()[3:5] == [0, 1]  # the token after the EOD starts document 1
    assert DocumentRule.from_config(load_config(GPTRunConfig, None, ["data.mock=true"]).data, E) is None
    assert torch.is_tensor(MicroBatches(samples, 2, 0, 1).next())  # without packed documents: plain tokens


def test_flex_on_a_cpu_run_is_a_config_error():
    from mmtrain.config import ConfigError, validate_gpt_config

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "train.device=cpu", "train.document_attention=flex"])
    with pytest.raises(ConfigError, match="train.document_attention=flex needs a GPU"):
        validate_gpt_config(cfg, 1)


def test_flex_flash_refusals_name_the_key_and_the_package(monkeypatch):
    """``flex_flash`` (FlexAttention's FLASH backend, flash-attn-4's kernels): on the CPU, and without
    flash-attn-4, a config error naming the key before anything starts; the kernel object refuses the CPU too."""
    import mmtrain.config.validate as validate
    from mmtrain.config import ConfigError, validate_gpt_config
    from mmtrain.model import attention

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "train.device=cpu",
                                           "train.document_attention=flex_flash"])
    with pytest.raises(ConfigError, match="train.document_attention=flex_flash needs a GPU"):
        validate_gpt_config(cfg, 1)
    monkeypatch.setattr(validate, "flash_available", lambda: False)
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "train.device=cuda",
                                           "train.document_attention=flex_flash"])
    with pytest.raises(ConfigError, match=r"flex_flash needs flash-attn-4 .*pip install 'mmtrain\[flash\]'"):
        validate_gpt_config(cfg, 1)
    with pytest.raises(ValueError, match="runs on CUDA GPUs only, not cpu"):
        attention.document_kernel("flex_flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend must be 'TRITON' or 'FLASH'"):
        attention.FlexDocuments(backend="flash")


def test_flex_flash_asks_flex_attention_for_the_flash_backend(monkeypatch):
    """Every flex call of the FLASH kernel object passes ``kernel_options={"BACKEND": "FLASH"}`` (plain, with
    sinks, with the log-sum-exp); the Triton one passes none, as before the option existed."""
    from mmtrain.model.attention import FlexDocuments

    seen = []

    def fake_flex(q, k, v, **kwargs):
        seen.append(kwargs.get("kernel_options", "missing"))
        out = torch.zeros_like(q)
        return (out, type("Aux", (), {"lse": torch.zeros(q.shape[:3])})()) if "return_aux" in kwargs else out

    q = k = v = torch.zeros(1, 2, 128, 16)
    for backend, expected in (("FLASH", {"BACKEND": "FLASH"}), ("TRITON", None)):
        kernel = FlexDocuments(backend=backend)
        monkeypatch.setattr(kernel, "_kernel", lambda q: fake_flex)
        seen.clear()
        kernel.attend(q, k, v, None, None)
        kernel.attend(q, k, v, None, None, sinks_H=torch.zeros(2))
        kernel.attend_with_lse(q, k, v, None, None)
        assert seen == [expected] * 3, backend
        assert kernel.name == ("flex_flash" if backend == "FLASH" else "flex")


@pytest.mark.parametrize("S,K,q_offset,window", [(1000, 1000, 0, None), (1000, 1000, 0, 300), (256, 512, 256, None)])
def test_block_mask_backward_side_equals_flex_own_transpose(S, K, q_offset, window):
    """The block mask's query-block lists (what flex's backward walks), built from the transposed keep matrices,
    equal what ``BlockMask.from_kv_blocks`` derives from the key-block lists."""
    from torch.nn.attention.flex_attention import BlockMask

    from mmtrain.model.attention import document_block_mask

    g = torch.Generator().manual_seed(0)
    ids = torch.cumsum((torch.rand(3, max(S, K), generator=g) < 1 / 150).int(), 1)
    mask = document_block_mask(ids[:, -S:], ids[:, :K], q_offset, 128, window)
    ref = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                   mask.full_kv_indices, BLOCK_SIZE=128, seq_lengths=(S, K))
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(mask, name), getattr(ref, name)), name
    # flex's kernels index these as contiguous: transposed strides (what a sort of the transposed matrices
    # keeps) gave the H200's packed 1B run gradient norms of 1e8 with a right loss
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert getattr(mask, name).is_contiguous(), name


def test_a_vlm_run_refuses_flex_on_the_cpu_too():
    """The document kernel's checks are the language run's, so a VLM run (its packing uses the same kernel) gets
    them before anything starts."""
    from mmtrain.config import ConfigError, VLMRunConfig, validate_vlm_config

    cfg = load_config(VLMRunConfig, None, ["data.mock=true", "train.device=cpu",
                                           "train.document_attention=flex_flash"])
    with pytest.raises(ConfigError, match="train.document_attention=flex_flash needs a GPU"):
        validate_vlm_config(cfg, 1)


def test_flash_is_unavailable_when_an_older_flash_attn_cannot_load(monkeypatch, tmp_path):
    """A ``flash_attn`` package (flash-attn 2) whose ``__init__`` fails to load its extension: not available,
    no traceback (the config check runs before anything starts)."""
    import sys

    from mmtrain.utils.optional import flash_available

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert flash_available() is False
