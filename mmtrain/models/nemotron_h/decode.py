"""Decoding a Nemotron-H model: the recurrent state cache and the Mamba-2 mixer's cached forward.

A Mamba layer carries no keys and values: what it needs of the past is its *state* -- the last ``conv_kernel - 1``
inputs of its causal convolution (x|B|C channels) and the scan's state (heads x head dim x state size, fp32) --
the same size whatever the position, so a Mamba layer's memory per sequence is constant however long it decodes.
The attention layers keep the shared static KV cache (``mmtrain.model.kv_cache.StaticKVCache``: rows by
position). ``HybridStateCache`` holds both, one row (slot) per sequence.

A slot whose call starts at position 0 starts from zero state (a new sequence: whatever the slot held before is
dropped, as attention drops stale keys by position); a call starting later continues the slot's state (a prompt
prefilled in pieces, then one token per step). The engine's batched prefill pads prompts of different lengths to
one length (``last_index_B``: where each row ends); a recurrent state would absorb the padding, so padded
positions get ``dt = 0`` (no decay, no input: the scan's state after them is the state after the row's last token)
and the convolution's state is taken at each row's own end. Outputs at padded positions are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmtrain.model.kv_cache import StaticKVCache
from mmtrain.models.nemotron_h.config import ATTENTION, MAMBA
from mmtrain.models.nemotron_h.mixer import Mamba2Mixer, causal_conv
from mmtrain.models.nemotron_h.ssd import ssd_scan, ssd_step


class HybridStateCache(StaticKVCache):
    """``k[a]`` / ``v[a]``: the static KV cache of the ``a``-th attention layer (``StaticKVCache``); ``conv[m]``:
    (slots, conv channels, conv_kernel - 1) in the model's dtype and ``ssm[m]``: (slots, heads, head dim, state
    size) in fp32, of the ``m``-th Mamba layer. Sizes are this rank's (a tensor-parallel shard holds its heads,
    groups and channels). Only the attention layers' tensors grow with ``max_len``."""

    def __init__(self, attention_layers: int, kv_heads: int, head_dim: int, mamba_layers: int, conv_channels: int,
                 conv_kernel: int, heads: int, mamba_head_dim: int, state_size: int, slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(attention_layers, slots, kv_heads, max_len, head_dim, dtype, device)
        self.conv = [torch.zeros(slots, conv_channels, conv_kernel - 1, dtype=dtype, device=device)
                     for _ in range(mamba_layers)]
        self.ssm = [torch.zeros(slots, heads, mamba_head_dim, state_size, dtype=torch.float32, device=device)
                    for _ in range(mamba_layers)]

    def buffers(self) -> list[torch.Tensor]:
        """Every preallocated tensor (a compiled step marks them as static addresses)."""
        return [*super().buffers(), *self.conv, *self.ssm]

    def read_state(self, layer: int, slots_B: torch.Tensor | None,
                   fresh_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state (B, channels, K - 1), scan state (B, H, P, N)) of Mamba layer ``layer`` for rows
        ``slots_B`` (None: every slot), zero for the rows where ``fresh_B`` (a sequence starting)."""
        conv, ssm = self.conv[layer], self.ssm[layer]
        if slots_B is not None:
            conv, ssm = conv[slots_B], ssm[slots_B]
        keep = ~fresh_B
        # where, not a product: a slot's stale state may hold anything (0 * inf is nan)
        return (torch.where(keep[:, None, None], conv, torch.zeros((), dtype=conv.dtype, device=conv.device)),
                torch.where(keep[:, None, None, None], ssm, torch.zeros((), dtype=ssm.dtype, device=ssm.device)))

    def write_state(self, layer: int, slots_B: torch.Tensor | None, conv_BCK: torch.Tensor,
                    ssm_BHPN: torch.Tensor) -> None:
        """Store Mamba layer ``layer``'s new states of rows ``slots_B`` (None: every slot, in order)."""
        conv, ssm = conv_BCK.to(self.conv[layer].dtype), ssm_BHPN.to(torch.float32)
        if slots_B is None:
            self.conv[layer].copy_(conv)
            self.ssm[layer].copy_(ssm)
        else:
            self.conv[layer][slots_B] = conv
            self.ssm[layer][slots_B] = ssm


def new_state_cache(layers, slots: int, max_len: int, dtype: torch.dtype,
                    device: torch.device | str) -> HybridStateCache:
    """A ``HybridStateCache`` for ``layers`` (the stage's blocks: ``kind`` and ``mixer``), sized off the mixers as
    they are on this rank."""
    attention = [layer.mixer for layer in layers if layer.kind == ATTENTION]
    mamba = [layer.mixer for layer in layers if layer.kind == MAMBA]
    kv_heads, head_dim = 1, 1
    if attention:
        attn = attention[0]
        kv_local = attn.qkv.weight.shape[0] * attn.kv_size // (attn.q_size + 2 * attn.kv_size)
        kv_heads, head_dim = kv_local // attn.head_dim, attn.head_dim
    channels, kernel, heads, P, N = 1, 1, 1, 1, 1
    if mamba:
        channels, kernel = mamba[0].conv1d.weight.shape[0], mamba[0].conv1d.weight.shape[-1]
        heads, P, N = mamba[0].local_sizes()[0], mamba[0].head_dim, mamba[0].state_size
    return HybridStateCache(len(attention), kv_heads, head_dim, len(mamba), channels, kernel, heads, P, N, slots,
                            max_len, dtype, device)


def mamba_decode(mixer: Mamba2Mixer, h_BSD: torch.Tensor, cache: HybridStateCache, layer: int,
                 slots_B: torch.Tensor | None, positions_BS: torch.Tensor,
                 last_index_B: torch.Tensor | None) -> torch.Tensor:
    """The mixer's forward on new tokens of rows ``slots_B`` at ``positions_BS``, continuing each row's state in
    ``cache`` (Mamba layer ``layer``) and storing the state after its last real token (``last_index_B``; None:
    the last column). One token: the recurrence (``ssd_step``); more: the chunked scan from the row's state."""
    B, S = h_BSD.shape[:2]
    z, xbc, dt = mixer.split_projection(mixer.in_proj(h_BSD))
    conv_state, ssm_state = cache.read_state(layer, slots_B, positions_BS[:, 0] == 0)
    K1 = conv_state.shape[-1]  # conv_kernel - 1 earlier inputs
    window = torch.cat([conv_state.transpose(1, 2).to(xbc.dtype), xbc], dim=1)  # (B, K - 1 + S, channels)
    xbc = F.silu(causal_conv(window, mixer.conv1d.weight, mixer.conv1d.bias)[:, K1:])
    if last_index_B is None:
        new_conv = window[:, S:]
    else:  # the K - 1 inputs ending at each row's last real token
        index = (last_index_B[:, None] + 1 + torch.arange(K1, device=window.device))[..., None]
        new_conv = window.gather(1, index.expand(-1, -1, window.shape[-1]))
    x, dt, A, Bm, Cm = mixer.scan_inputs(xbc, dt)
    if last_index_B is not None:  # padding: no decay, no input
        valid = torch.arange(S, device=dt.device)[None, :] <= last_index_B[:, None]
        dt = torch.where(valid[..., None], dt, torch.zeros((), dtype=dt.dtype, device=dt.device))
    if S == 1:
        y, new_ssm = ssd_step(ssm_state, x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0])
        y = y[:, None]
    else:
        y, new_ssm = ssd_scan(x, dt, A, Bm, Cm, mixer.chunk_size, None, ssm_state)
    cache.write_state(layer, slots_B, new_conv.transpose(1, 2), new_ssm)
    return mixer.finish(y, x, z)
