"""Ring context parallelism (``parallel.cp_comm=ring``): CP2 and CP4 equal one process -- per-token losses and
every gradient -- without documents, with packed documents that cross the zig-zag chunk boundaries (dense
masks, the CPU kernel, and FlexAttention block masks, the GPU kernel run on the CPU), and the number of
point-to-point exchanges per layer is the ring's: cp-1 forward, cp+1 backward, no K/V all-gather.
Training-level proofs (TP2 x CP2 with sequence parallelism, packed CP2 over 10 steps) are layouts of
tests/distributed/test_gpt_parallel_equivalence.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.documents import packed_document_inputs
from mmtrain.model.attention_ring import ring_calls
from mmtrain.parallel.context import shard_sequence
from mmtrain.testing import run_distributed

S, LAYERS = 32, 2


def _cfg():
    return load_config(GPTRunConfig, None, ["data.mock=true", "model.vocab_size=64", "model.hidden_size=32",
                                           "model.ffn_hidden_size=64", "model.num_attention_heads=4",
                                           "model.num_query_groups=2", f"model.num_layers={LAYERS}"]).model


def _batch(with_docs: bool):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (2, S + 1), generator=g)
    if not with_docs:
        return tokens, torch.arange(S).expand(2, S), None
    tokens[0, [3, 4, 11, 17, 25]] = 0  # documents of 4, 1, 7, 6, 8, 7 tokens: most cross a chunk boundary
    tokens[1, [15]] = 0
    positions, doc_ids, _ = packed_document_inputs(tokens, 0, True, True, True)
    return tokens, positions, doc_ids


class _Counts:
    """Counts the collectives the model issues: batched point-to-point calls (and their ops), all-gathers and
    reduce-scatters of tensors."""

    def __init__(self) -> None:
        self.batches, self.p2p_ops, self.all_gathers, self.reduce_scatters = 0, 0, 0, 0
        self._saved = dist.batch_isend_irecv, dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def __enter__(self):
        batch, gather, scatter = self._saved

        def counted_batch(ops):
            self.batches, self.p2p_ops = self.batches + 1, self.p2p_ops + len(ops)
            return batch(ops)

        def counted_gather(*a, **k):
            self.all_gathers += 1
            return gather(*a, **k)

        def counted_scatter(*a, **k):
            self.reduce_scatters += 1
            return scatter(*a, **k)

        dist.batch_isend_irecv, dist.all_gather_into_tensor, dist.reduce_scatter_tensor = (
            counted_batch, counted_gather, counted_scatter)
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_gather_into_tensor, dist.reduce_scatter_tensor = self._saved

    def as_tuple(self):
        return self.batches, self.p2p_ops, self.all_gathers, self.reduce_scatters


def _one_process(with_docs: bool):
    """The reference: per-token losses and gradients of the whole sequence in this process (no CP)."""
    from mmtrain.model.attention import CausalAttention
    from mmtrain.models.llama.model import GPTModel

    tokens, positions, doc_ids = _batch(with_docs)
    model = GPTModel(_cfg(), attention=CausalAttention())
    model.init_weights(3)
    losses = model(tokens[:, :-1], tokens[:, 1:], positions, doc_ids)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _forward_backward(rank: int, world_size: int, with_docs: bool, comm: str):
    from mmtrain.model.attention_cp import attention_for
    from mmtrain.models.llama.model import GPTModel

    tokens, positions, doc_ids = _batch(with_docs)
    group = dist.new_group(list(range(world_size)))
    model = GPTModel(_cfg(), attention=attention_for(group, "auto", comm))
    model.init_weights(3)
    shard = lambda t: None if t is None else shard_sequence(t, world_size, rank)  # noqa: E731
    with _Counts() as counts:
        losses = model(shard(tokens[:, :-1]), shard(tokens[:, 1:]), shard(positions), shard(doc_ids))
        losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for t in grads.values():
        dist.all_reduce(t, group=group)
    kernel = model.attention.kernel_for(torch.device("cpu")).name
    return losses.detach(), grads, counts.as_tuple(), kernel


def _flex_ring_attention(rank: int, world_size: int):
    """One attention call on the ring with FlexAttention block masks (the GPU's document kernel, made to run
    on the CPU) against the dense kernel over the whole sequence in this process: output and Q/K/V gradients
    of this rank's chunks. Attention only: eager flex on the CPU costs ~1 s a call."""
    from mmtrain.model.attention import CausalAttention
    from mmtrain.model.attention_cp import attention_for
    from tests.distributed.test_packed_attention import _use_flex_on_cpu

    _, _, doc_ids = _batch(True)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, h, S, 8, generator=g) for h in (4, 2, 2, 4))
    reference = CausalAttention("dense")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference(*full, reference.prepare(doc_ids))
    ref_out.backward(dout)
    _use_flex_on_cpu()
    ring = attention_for(dist.new_group(list(range(world_size))), "auto", "ring")
    shard = lambda t: shard_sequence(t, world_size, rank, dim=2)  # noqa: E731
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ring(*mine, ring.prepare(shard_sequence(doc_ids, world_size, rank)))
    out.backward(shard(dout))
    diffs = {"out": (out.detach() - shard(ref_out.detach())).abs().max()}
    diffs.update({f"d{n}": (t.grad - shard(f.grad)).abs().max() for n, t, f in zip("qkv", mine, full)})
    return ring.kernel_for(torch.device("cpu")).name, {n: float(d) for n, d in diffs.items()}


def _cases(rank: int, world_size: int, cases: list[tuple[bool, str]], flex: bool):
    """Several forward-backwards in one process group, then (``flex``) the flex-kernel attention check, which
    swaps this worker process's document kernel."""
    out = [_forward_backward(rank, world_size, with_docs, comm) for with_docs, comm in cases]
    reference = {with_docs: _one_process(with_docs) for with_docs in (False, True)} if rank == 0 else None
    return out, _flex_ring_attention(rank, world_size) if flex else None, reference


# (documents, cp_comm); the all-gather's counts and the flex kernel are checked at CP2
CASES = {2: [(False, "ring"), (True, "ring"), (False, "allgather")], 4: [(False, "ring"), (True, "ring")]}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_one_process_with_and_without_documents(cp):
    per_rank = run_distributed(_cases, cp, CASES[cp], cp == 2)
    reference = per_rank[0][2]  # rank 0 also ran the whole sequence alone
    for rank, (results, flex, _) in enumerate(per_rank):
        if flex is not None:
            kernel, diffs = flex
            assert kernel == "flex" and max(diffs.values()) < 1e-5, (rank, kernel, diffs)
        for (losses, grads, counts, kernel), (with_docs, comm) in zip(results, CASES[cp]):
            ref_losses, ref_grads = reference[with_docs]
            what = f"cp{cp} rank {rank} docs={with_docs} {comm} {kernel}"
            assert kernel == "dense", what
            torch.testing.assert_close(losses, shard_sequence(ref_losses, cp, rank), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, w=what: f"{w}: {m}")
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
            batches, p2p_ops, gathers, scatters = counts
            if comm == "ring":  # per layer: cp-1 exchanges forward, cp+1 backward; K/V never all-gathered
                assert batches == LAYERS * 2 * cp, what
                # a send and a receive per exchange, two of each while K/V and dK/dV both travel (backward
                # steps 1..cp-2): forward 2(cp-1), backward 2 + 4(cp-2) + 2 + 2 (dK/dV home)
                assert p2p_ops == LAYERS * (6 * cp - 4), what
                assert gathers == (1 if with_docs else 0) and scatters == 0, what  # the document ids, once
            else:  # K and V all-gathered per layer, their gradients reduce-scattered
                assert (batches, gathers, scatters) == (0, 2 * LAYERS, 2 * LAYERS), what


def test_ring_schedule_covers_every_causal_pair_once():
    """Over the cp steps, each rank's query chunks meet every earlier-or-equal key chunk exactly once,
    diagonal pairs causal, the others full; later key chunks never."""
    for cp in (1, 2, 3, 4):
        for rank in range(cp):
            mine = (rank, 2 * cp - 1 - rank)
            met = []
            for step in range(cp):
                src = (rank - step) % cp
                block = (src, 2 * cp - 1 - src)
                for qs, ks, causal in ring_calls(cp, rank, step):
                    for qc in mine[qs]:
                        for kc in block[ks]:
                            assert kc <= qc and causal == (kc == qc), (cp, rank, step, qc, kc)
                            met.append((qc, kc))
            assert sorted(met) == sorted((q, k) for q in mine for k in range(q + 1)), (cp, rank)
