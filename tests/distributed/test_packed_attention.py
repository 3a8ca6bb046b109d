"""Packed documents through the FlexAttention block-mask path train exactly like one process on the dense-mask
reference: one process, CP2 (documents crossing the zig-zag chunk boundaries, block masks per chunk pair), TP2
with sequence parallelism and PP2 -- the same losses every step and the same weights after four steps (fp32,
CPU, gloo). A CP2/CP4 forward-backward also matches per-token losses and every gradient.

The worker processes lift FlexAttention's CPU-backward refusal and make the "auto" kernel flex (with small
blocks, so the short test sequences span several blocks); the reference runs the production CPU kernel
(dense). See tests/unit/test_document_attention.py for why the refusal can be lifted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.parallel import ParallelDims
from mmtrain.parallel.context import shard_sequence
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

S = 32
# 4 steps (1 of warmup), as in tests/distributed/test_gpt_parallel_equivalence.py: a layout's gradient difference
# compounds over them into the weights (the CPU flex path's steps are most of this file's time)
BASE = ["data.mock=true", f"data.seq_length={S}", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=1", "optim.lr=3e-3",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=64",
        "data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]


def _packed_mock_sample(self, index: int) -> torch.Tensor:
    """Mock samples with many documents: every fourth has no EOD at all, the next is all EOD (one-token
    documents), the others an EOD about every five tokens (token 0 is the mock data's EOD)."""
    g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
    tokens = torch.randint(1, self.vocab_size, (self.seq_length + 1,), generator=g)
    if index % 4 == 1:
        tokens[:] = 0
    elif index % 4 > 1:
        tokens[torch.rand(self.seq_length + 1, generator=g) < 0.2] = 0
    return tokens


def _use_flex_on_cpu() -> None:
    import warnings

    import torch.nn.attention.flex_attention as flex_module

    import mmtrain.model.attention as attention

    flex_module._validate_device = lambda q, k, v: None
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    attention.document_kernel = lambda name, device: attention.FlexDocuments(block=4)


def _train(rank: int, world_size: int, run_dir: str, extra: list[str], flex: bool):
    from mmtrain.data.mock import MockGPTSamples

    MockGPTSamples.__getitem__ = _packed_mock_sample  # this worker process only
    if flex:
        _use_flex_on_cpu()
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", *extra])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    kernel = result.model.attention.kernel_for(torch.device("cpu")).name
    params = {k: v.detach().clone() for k, v in result.model.named_parameters()}
    return result.losses, params, tuple(mesh.coord), mesh.dims.tp, kernel


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    return run_distributed(_train, 1, str(tmp_path_factory.mktemp("dense")), [], False)[0]


@pytest.mark.parametrize("world_size, layout", [
    (1, []),
    (2, ["parallel.cp=2"]),
    # CP4 is checked below, every gradient of a forward-backward with documents across its chunks: training it
    # for steps too cost a third of this file and checked nothing that CP2 training and that check leave out
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.pp=2"]),
], ids=lambda v: ",".join(v) if isinstance(v, list) else str(v))
def test_flex_documents_train_like_the_dense_reference(dense_reference, tmp_path, world_size, layout):
    ref_losses, ref_params, _, _, ref_kernel = dense_reference
    assert ref_kernel == "dense"
    spec = llama_sharding_spec(load_config(GPTRunConfig, None, BASE).model)
    for losses, params, coord, tp, kernel in run_distributed(_train, world_size, str(tmp_path), layout, True):
        assert kernel == "flex"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            expected = tp_shard_of(name, ref_params[name], spec, coord[0], tp)
            rel = (value - expected).norm() / expected.norm().clamp_min(1e-12)
            assert rel < 2e-5, f"{name}: relative difference {rel:.2e} (rank coord {coord})"


def _forward_backward(rank: int, world_size: int, flex: bool):
    """Per-token losses and all-reduced gradients of one packed micro-batch whose documents cross chunks."""
    from mmtrain.model.attention_cp import attention_for
    from mmtrain.models.llama.model import GPTModel

    if flex:
        _use_flex_on_cpu()
    cfg = load_config(GPTRunConfig, None, BASE).model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (2, S + 1), generator=g)
    tokens[0, [3, 4, 11, 17, 25]] = 0  # documents of 4, 1, 7, 6, 8, 7 tokens: most cross a chunk boundary
    tokens[1, [15]] = 0
    positions, doc_ids, _ = packed_document_inputs(tokens, 0, True, True, True)
    group = dist.new_group(list(range(world_size)))
    model = GPTModel(cfg, attention=attention_for(group))
    model.init_weights(3)
    shard = lambda t: shard_sequence(t, world_size, rank)  # noqa: E731
    losses = model(shard(tokens[:, :-1]), shard(tokens[:, 1:]), shard(positions), shard(doc_ids))
    losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for t in grads.values():
        dist.all_reduce(t, group=group)
    return losses.detach(), grads


@pytest.fixture(scope="module")
def dense_forward_backward():
    """The one-process reference of both CP sizes (one launch, not one each)."""
    return run_distributed(_forward_backward, 1, False)[0]


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_block_masks_match_one_dense_process(dense_forward_backward, cp):
    ref_losses, ref_grads = dense_forward_backward
    for rank, (losses, grads) in enumerate(run_distributed(_forward_backward, cp, True)):
        torch.testing.assert_close(losses, shard_sequence(ref_losses, cp, rank), rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
