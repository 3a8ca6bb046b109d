"""Context parallelism: each sequence is split over the ``cp`` ranks; attention all-gathers keys and values.

Load balance (zig-zag): the sequence is cut into ``2·cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2·cp−1−r``, so every rank gets one early (cheap under the causal mask) and one late (expensive) chunk.

Attention (the Llama 3 approach): every layer all-gathers K and V over the CP group (backward: reduce-scatter
of their gradients), and each local query chunk attends to the keys up to its own end with a bottom-right
causal mask. Why all-gather rather than a ring: with GQA, K/V are small (here 8 of 32 heads), so one gather is
cheap and lets each chunk run a single fused attention call; a ring needs 2·cp partial calls plus
log-sum-exp merging, and its overlap gain is smallest exactly where GQA already shrinks the traffic.

RoPE uses each token's global position (the loop passes them); document masks use each token's document id,
gathered the same way as K/V. The loss is summed over local tokens and averaged over the dp×cp group.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmtrain.parallel.comm import _all_gather, gather_seq


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


def _global_order(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Re-order an all-gather of zig-zag shards ([r0: c0 c_last], [r1: c1 c_last-1], ...) into sequence order."""
    chunks = gathered.chunk(2 * cp, dim=dim)
    order = [None] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = chunks[2 * r], chunks[2 * r + 1]
    return torch.cat(order, dim=dim)


def _cp_attention(q, k, v, attn_mask, group) -> torch.Tensor:
    """Causal attention of the two local query chunks against the gathered keys/values (B, H, S, D)."""
    # imported here: the module pulls in torch._dynamo (~1 s of every process start that never uses CP)
    from torch.nn.attention.bias import causal_lower_right

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    k_all = _global_order(gather_seq(k, group, dim=2), cp, 2)
    v_all = _global_order(gather_seq(v, group, dim=2), cp, 2)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):
        kv_len = (g + 1) * c
        qj = q[:, :, j * c:(j + 1) * c]
        mask = causal_lower_right(c, kv_len) if attn_mask is None else attn_mask[j]
        outs.append(F.scaled_dot_product_attention(qj, k_all[:, :, :kv_len], v_all[:, :, :kv_len], attn_mask=mask,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def _cp_document_masks(doc_ids_BS: torch.Tensor, group) -> list[torch.Tensor]:
    """Per local chunk: bool (B, 1, c, kv_len) — same document and bottom-right causal."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = doc_ids_BS.shape[1] // 2
    all_ids = _global_order(_all_gather(doc_ids_BS, 1, group), cp, 1)
    masks = []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):
        kv_len = (g + 1) * c
        q_ids, k_ids = doc_ids_BS[:, j * c:(j + 1) * c], all_ids[:, :kv_len]
        causal = torch.ones(c, kv_len, dtype=torch.bool, device=doc_ids_BS.device).tril(kv_len - c)
        masks.append(((q_ids[:, :, None] == k_ids[:, None, :]) & causal)[:, None])
    return masks


def apply_context_parallel(model: torch.nn.Module, group) -> torch.nn.Module:
    """Make every attention layer of a GPT (stage) context-parallel over ``group``, in place."""
    if dist.get_world_size(group) == 1:
        return model
    for block in model.layers.values():
        block.attn.core_attention = partial(_cp_attention, group=group)
    model.build_attention_mask = partial(_cp_document_masks, group=group)
    return model
