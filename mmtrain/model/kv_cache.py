"""Static, preallocated key/value caches: one (slots, kv heads, max length, head dim) buffer pair per layer
(``StaticKVCache``), or for multi-head latent attention one buffer of per-token latents (``LatentKVCache``).

Static shapes are what let the decode step run under ``torch.compile`` with CUDA graphs: nothing is allocated or
resized while decoding. A *slot* is one sequence's row; its token at position ``p`` is stored at index ``p``, so
rows of different lengths share the buffers without padding (each row's queries only see keys at positions up to
their own, the mask ``key index <= query position``). A slot is reused by overwriting: stale keys beyond a new
sequence's positions are never attended.

The families' cached forwards (``decode`` of the family contract, ``mmtrain.models.contract``) write and read
these and attend through ``cached_attention``, the one decode core (sliding window, sinks and softcap as in
training, ``mmtrain.model.attention``); ``mmtrain.inference`` makes the caches through the model
(``new_kv_cache``) and never looks inside a model.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mmtrain.model.attention import apply_sinks, dense_attention_with_lse


class StaticKVCache:
    """``k[layer]``/``v[layer]``: (slots, kv_heads, max_len, head_dim) tensors. ``kv_heads`` is this rank's count
    (a tensor-parallel shard holds kv_heads / tp)."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.max_len = slots, max_len
        # key index of every cached position, for the attention mask (kept to avoid an arange per step)
        self.key_index = torch.arange(max_len, device=device)

    def write(self, layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor, k_BSHD: torch.Tensor,
              v_BSHD: torch.Tensor) -> None:
        """Store the new keys/values of rows ``slots_B`` (None: every slot, in order) at their positions."""
        rows = (torch.arange(positions_BS.shape[0], device=positions_BS.device) if slots_B is None else slots_B)
        # advanced indices on dims 0 and 2 around a slice: the indexed view is (B, S, kv_heads, head_dim)
        index = (rows[:, None].expand_as(positions_BS), positions_BS)
        _put(self.k[layer], index, k_BSHD)
        _put(self.v[layer], index, v_BSHD)

    def read(self, layer: int, slots_B: torch.Tensor | None,
             length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of rows ``slots_B`` (None: every slot, no copy), the first ``length`` positions (None: all)."""
        k, v = self.k[layer], self.v[layer]
        if slots_B is not None:
            k, v = k[slots_B], v[slots_B]
        if length is not None and length < self.max_len:
            k, v = k[:, :, :length], v[:, :, :length]
        return k, v

    def buffers(self) -> list[torch.Tensor]:
        """Every preallocated tensor (a compiled step marks them as static addresses)."""
        return [*self.k, *self.v]


class LatentKVCache:
    """``entries[layer]``: (slots, 1, max_len, width) -- per token what multi-head latent attention computes its
    keys and values from (DeepSeek-V3: the normalized KV latent and the rotated shared RoPE key,
    ``kv_lora_rank + qk_rope_head_dim`` numbers for all heads together). The same on every tensor-parallel
    rank: the latent is not split by heads. Slots and positions as in ``StaticKVCache``."""

    def __init__(self, num_layers: int, slots: int, max_len: int, width: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.entries = [torch.zeros((slots, 1, max_len, width), dtype=dtype, device=device)
                        for _ in range(num_layers)]
        self.slots, self.max_len = slots, max_len
        self.key_index = torch.arange(max_len, device=device)

    def write(self, layer: int, slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
              entries_BS1W: torch.Tensor) -> None:
        """Store the new tokens' entries (B, S, 1, width) of rows ``slots_B`` (None: every slot) at their positions."""
        rows = (torch.arange(positions_BS.shape[0], device=positions_BS.device) if slots_B is None else slots_B)
        _put(self.entries[layer], (rows[:, None].expand_as(positions_BS), positions_BS), entries_BS1W)

    def read(self, layer: int, slots_B: torch.Tensor | None, length: int | None = None) -> torch.Tensor:
        """Entries (B, 1, T, width) of rows ``slots_B`` (None: every slot, no copy), the first ``length`` positions."""
        e = self.entries[layer]
        if slots_B is not None:
            e = e[slots_B]
        return e[:, :, :length] if length is not None and length < self.max_len else e

    def buffers(self) -> list[torch.Tensor]:
        """Every preallocated tensor (a compiled step marks them as static addresses)."""
        return list(self.entries)


def cached_attention(q_BSHD: torch.Tensor, keys_BHTD: torch.Tensor, values_BHTD: torch.Tensor,
                     key_index_T: torch.Tensor, positions_BS: torch.Tensor, scale: float | None = None,
                     window: int | None = None, sinks_H: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """New queries (B, S, H, D) against cached keys/values (B, KV heads, T, D) whose positions are ``key_index_T``;
    returns (B, S, H, D). Key t is visible to the query at position p iff key_index[t] <= p and, with a
    ``window``, p - key_index[t] < window. ``scale``/``sinks_H``/``softcap`` as the training strategies take them.
    Shapes are static and nothing depends on the data: one graph for a compiled / CUDA-graphed decode step (the
    plain case is the SDPA call of the bare cache).

    As many queries as keys (S == T) is a prefill from position 0: S queries that see their own keys among T
    cached positions can only sit at positions 0..S-1, so the mask is the causal one. That call runs causal
    without a mask (``from_start_attention``)."""
    if q_BSHD.shape[1] == keys_BHTD.shape[2] and sinks_H is None and softcap is None and (
            window is None or window >= keys_BHTD.shape[2]):
        return from_start_attention(q_BSHD, keys_BHTD, values_BHTD, scale)
    if window is None:  # the plain decode step's one comparison
        visible = key_index_T[None, None, None, :] <= positions_BS[:, None, :, None]  # (B, 1, S, T)
    else:
        distance = positions_BS[:, None, :, None] - key_index_T[None, None, None, :]
        visible = (distance >= 0) & (distance < window)
    q = q_BSHD.transpose(1, 2)
    keys, values = keys_BHTD.to(q.dtype), values_BHTD.to(q.dtype)
    if sinks_H is None and softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                             enable_gqa=q.shape[1] != keys.shape[1])
    else:
        out, lse = dense_attention_with_lse(q, keys, values, visible, scale, softcap)
        out = out if sinks_H is None else apply_sinks(out, lse, sinks_H)
    return out.transpose(1, 2)


def one_token_kernel_applies(q_BSHD: torch.Tensor, cache, slots_B: torch.Tensor | None, kv_len: int | None,
                             window: int | None) -> bool:
    """Whether a cached attention goes through ``one_token_attention``'s one kernel: a decode step (one new
    token in every slot: ``slots_B`` and ``kv_len`` None), plain causal (no window), on a GPU, a
    ``StaticKVCache`` of the query's dtype, shapes the kernel takes (``decode_attention.supported``)."""
    if not (q_BSHD.is_cuda and q_BSHD.shape[1] == 1 and slots_B is None and kv_len is None and window is None
            and type(cache) is StaticKVCache and q_BSHD.shape[0] == cache.slots):
        return False
    from mmtrain.model import decode_attention  # imports Triton: only on a GPU
    keys = cache.k[0]
    return keys.dtype == q_BSHD.dtype and decode_attention.supported(q_BSHD.shape[3], q_BSHD.shape[2],
                                                                     keys.shape[1], keys.dtype)


def one_token_attention(q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor, cos: torch.Tensor | None,
                        sin: torch.Tensor | None, cache: StaticKVCache, layer: int,
                        positions_BS: torch.Tensor) -> torch.Tensor:
    """A decode step's attention (``one_token_kernel_applies``) as one kernel (``mmtrain.model.decode_attention``):
    RoPE (``cos``/``sin`` (B, 1, 1, D); None: none) on the new query and key, the key and value written into
    ``cache`` at each row's position, each query over its row's positions up to its own. Returns (B, 1, H, D)."""
    from mmtrain.model.decode_attention import decode_attention
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    return decode_attention(q_BSHD, k_BSHD, v_BSHD, cos, sin, cache.k[layer], cache.v[layer], positions_BS)


# The kernels a causal prefill runs with on a GPU: flash attention (which takes grouped-query heads unexpanded),
# else math. cuDNN's attention, PyTorch's first choice on an H100/H200, builds an execution plan for every new
# shape, and a prefill's shape (prompts that joined together, the longest of them) changes call to call: on the
# H200 the first prefill of a new batch size waited 64-85 ms for it, of a new length 0.6-1.2 s; flash needs no plan
# and was as fast after (bench/prefill_shapes.py, bench/results/h200_2026-12-04_s21.md).
FROM_START_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def from_start_attention(q_BSHD: torch.Tensor, keys_BHTD: torch.Tensor, values_BHTD: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention of the queries (B, S, H, D) of positions 0..S-1 over their own S keys/values (B, KV heads,
    S, D); returns (B, S, H, D)."""
    q = q_BSHD.transpose(1, 2)
    keys, values = keys_BHTD.to(q.dtype), values_BHTD.to(q.dtype)
    with sdpa_kernel(FROM_START_KERNELS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


def decoded_rows(x_BSD: torch.Tensor, last_index_B: torch.Tensor | None) -> torch.Tensor:
    """The hidden states (B, 1, D) of the one position per row whose logits a cached forward returns:
    ``last_index_B[b]`` (None: the last column)."""
    if last_index_B is None:
        return x_BSD[:, -1:]
    return x_BSD[torch.arange(x_BSD.shape[0], device=x_BSD.device), last_index_B][:, None]


def _put(buffer: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], values_BSHD: torch.Tensor) -> None:
    rows, positions = index
    buffer[rows, :, positions] = values_BSHD.to(buffer.dtype)
