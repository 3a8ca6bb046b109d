"""Context parallelism: each sequence is split over the ``cp`` ranks (zig-zag); attention exchanges K/V.

Load balance (zig-zag): the sequence is cut into ``2·cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2·cp−1−r``, so every rank gets one early (cheap under the causal mask) and one late (expensive) chunk.

This module holds the sequence arithmetic: which chunks a rank holds (``zigzag_indices``), its shard of any
per-token tensor (``shard_sequence``: tokens, labels, positions, document ids) and the reordering of an
all-gather of shards (``zigzag_global_order``). The attention itself is a strategy object the model is built
with, ``mmtrain.model.attention_cp.ContextParallelAttention`` (K/V all-gather, per-chunk causal or
document block masks) or ``mmtrain.model.attention_ring.RingContextParallelAttention`` (K/V ring behind
attention, ``parallel.cp_comm=ring``); RoPE uses each token's global position, which the loop shards like the tokens. The
loss is summed over local tokens and averaged over the dp×cp group.
"""

from __future__ import annotations

import torch


def zigzag_indices(seq_len: int, cp: int, rank: int) -> tuple[int, int, int]:
    """(chunk size, first global chunk index, second global chunk index) held by ``rank``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    return seq_len // (2 * cp), rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two zig-zag chunks of ``x`` along ``dim`` (tokens, labels, positions, document ids)."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def zigzag_global_order(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Re-order an all-gather of zig-zag shards ([r0: c0 c_last], [r1: c1 c_last-1], ...) into sequence order."""
    chunks = gathered.chunk(2 * cp, dim=dim)
    order = [None] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = chunks[2 * r], chunks[2 * r + 1]
    return torch.cat(order, dim=dim)
