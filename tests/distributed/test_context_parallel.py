"""CP2 and CP4 equal one process — per-token losses and gradients — with and without packed-document masks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.model.attention_cp import attention_for
from mmtrain.models.llama.model import GPTModel
from mmtrain.parallel.context import (
    shard_sequence,
    zigzag_indices,
)
from mmtrain.testing import run_distributed

S = 32


def _inputs(with_docs: bool):
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=64", "model.hidden_size=32",
                                           "model.ffn_hidden_size=64", "model.num_query_groups=2"]).model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, S + 1), generator=g)
    if with_docs:  # documents of uneven lengths, positions restart at each
        bounds = [0, 5, 13, 14, 27, S]
        doc_ids = torch.zeros(2, S, dtype=torch.long)
        positions = torch.zeros(2, S, dtype=torch.long)
        for d, (a, b) in enumerate(itertools.pairwise(bounds)):
            doc_ids[:, a:b] = d
            positions[:, a:b] = torch.arange(b - a)
    else:
        doc_ids, positions = None, torch.arange(S).expand(2, S)
    return cfg, tokens, positions, doc_ids


def _run(rank: int, world_size: int, with_docs: bool):
    cfg, tokens, positions, doc_ids = _inputs(with_docs)
    group = dist.new_group(list(range(world_size)))
    model = GPTModel(cfg, attention=attention_for(group))
    model.init_weights(3)
    shard = lambda t: None if t is None else shard_sequence(t, world_size, rank)
    losses = model(shard(tokens[:, :-1]), shard(tokens[:, 1:]), shard(positions), shard(doc_ids))
    losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return losses.detach(), grads


@pytest.fixture(scope="module")
def one_process():
    """The one-process run for each input, made once and shared by the CP2 and CP4 tests."""
    cache = {}

    def get(with_docs: bool):
        if with_docs not in cache:
            cache[with_docs] = run_distributed(_run, 1, with_docs)[0]
        return cache[with_docs]
    return get


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_docs", [False, True])
def test_context_parallel_matches_one_process(one_process, cp, with_docs):
    ref_losses, ref_grads = one_process(with_docs)
    for rank, (losses, grads) in enumerate(run_distributed(_run, cp, with_docs)):
        torch.testing.assert_close(losses, shard_sequence(ref_losses, cp, rank), rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_zigzag_balances_chunks():
    assert zigzag_indices(32, 4, 0) == (4, 0, 7) and zigzag_indices(32, 4, 3) == (4, 3, 4)
    x = torch.arange(8)[None]
    assert shard_sequence(x, 2, 0).tolist() == [[0, 1, 6, 7]] and shard_sequence(x, 2, 1).tolist() == [[2, 3, 4, 5]]
