"""The Mamba-2 mixer of a Nemotron-H layer, for one device (or one tensor-parallel rank).

``in_proj`` makes, per token, [z | x | B | C | dt] (gate, input, the groups' input and output matrices, one step
size per head). x|B|C goes through a depthwise causal convolution and SiLU; ``dt = softplus(dt + dt_bias)``
clamped to ``time_step_limit``; ``A = -exp(A_log)`` per head; the scan (``ssd.ssd_scan``) gives y; ``y + D x``
(per head); a gated RMSNorm ``norm(y * silu(z))`` normalized per group of channels; ``out_proj``. This is the
math of transformers' ``NemotronHMamba2Mixer`` (its PyTorch path).

Tensor parallelism (``spec.py``) splits heads and groups as Megatron's ``MambaMixer`` does: every segment of
``in_proj`` column-wise, the convolution's channels, ``dt_bias``/``A_log``/``D`` by head, the gated norm by group,
``out_proj`` row-wise. So sizes are read off the local tensors here (heads = ``A_log``'s length), never the config.

Packed documents: the convolution and the scan stay inside each document (``doc_ids_BS``), so a packed row
equals its documents run one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.models.nemotron_h.config import NemotronHConfig
from mmtrain.models.nemotron_h.ssd import at_least_fp32, ssd_scan


def causal_conv(x_BSC: torch.Tensor, weight_C1K: torch.Tensor, bias_C: torch.Tensor | None,
                doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution along the sequence (the last tap is the current token), in (at least) fp32,
    returned in ``x``'s dtype. With ``doc_ids_BS`` a token's window sees only earlier tokens of its own document (zeros
    before the document's start). Written as a sum of shifted copies: K is small (4), and the document mask is
    one comparison per tap."""
    K = weight_C1K.shape[-1]
    S = x_BSC.shape[1]
    w = at_least_fp32(weight_C1K[:, 0, :])  # (C, K)
    x = at_least_fp32(x_BSC)
    out = x * w[:, K - 1]
    for shift in range(1, min(K, S)):
        earlier = F.pad(x, (0, 0, shift, 0))[:, :S]  # the token `shift` places before (zero before the start)
        if doc_ids_BS is not None:
            same = doc_ids_BS == F.pad(doc_ids_BS, (shift, 0))[:, :S]  # the padded ids meet zeros of x
            earlier = earlier * same[..., None]
        out = out + earlier * w[:, K - 1 - shift]
    if bias_C is not None:
        out = out + at_least_fp32(bias_C)
    return out.to(x_BSC.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))`` with the mean square taken per group of ``group_size`` channels (the
    mixer's groups); fp32 inside, cast to ``y``'s dtype before the weight, as transformers computes it. A TP rank
    holds whole groups, so the norm is local."""

    def __init__(self, width: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = at_least_fp32(y) * F.silu(at_least_fp32(z))
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(h).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """The mixer of the module docstring. Parameter names are transformers' (``in_proj``, ``conv1d``, ``dt_bias``,
    ``A_log``, ``D``, ``norm``, ``out_proj``); call the stage's ``init_weights``."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        H, G, N = cfg.mamba_num_heads, cfg.n_groups, cfg.ssm_state_size
        inner = cfg.mamba_inner_size
        self.head_dim, self.state_size, self.heads_per_group = cfg.mamba_head_dim, N, H // G
        self.chunk_size = cfg.chunk_size
        self.dt_low, self.dt_high = cfg.dt_limit()
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * inner + 2 * G * N + H, bias=cfg.use_bias)
        conv_channels = inner + 2 * G * N
        self.conv1d = nn.Conv1d(conv_channels, conv_channels, cfg.conv_kernel, groups=conv_channels,
                                bias=cfg.use_conv_bias)  # its weight and bias only; causal_conv applies them
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = GatedRMSNorm(inner, inner // G, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.use_bias)

    def local_sizes(self) -> tuple[int, int, int]:
        """(heads, groups, inner width) this rank holds."""
        heads = self.A_log.shape[0]
        return heads, heads // self.heads_per_group, heads * self.head_dim

    def split_projection(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``in_proj``'s output as (z, x|B|C, dt) of this rank's heads and groups."""
        heads, groups, inner = self.local_sizes()
        return zxbcdt.split([inner, inner + 2 * groups * self.state_size, heads], dim=-1)

    def scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved and activated x|B|C and the raw dt as the scan takes them: x (B, S, H, P), dt (B, S, H)
        softplus'ed, biased and clamped, A (H,), B and C (B, S, G, N)."""
        heads, groups, inner = self.local_sizes()
        x, Bm, Cm = xbc.split([inner, groups * self.state_size, groups * self.state_size], dim=-1)
        lead = x.shape[:-1]
        dt = F.softplus(at_least_fp32(dt) + at_least_fp32(self.dt_bias)).clamp(self.dt_low, self.dt_high)
        A = -torch.exp(at_least_fp32(self.A_log))
        return (x.reshape(*lead, heads, self.head_dim), dt, A, Bm.reshape(*lead, groups, self.state_size),
                Cm.reshape(*lead, groups, self.state_size))

    def finish(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The D skip, the gated norm and ``out_proj`` on the scan's output (y and x: (..., H, P))."""
        y = (at_least_fp32(y) + at_least_fp32(x) * at_least_fp32(self.D)[:, None]).to(x.dtype)
        return self.out_proj(self.norm(y.flatten(-2), z))

    def forward(self, hidden_BSD: torch.Tensor, doc_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``doc_ids_BS``: the document of each token of packed sequences (convolution and state stay inside
        documents); None: one sequence per row."""
        z, xbc, dt = self.split_projection(self.in_proj(hidden_BSD))
        xbc = F.silu(causal_conv(xbc, self.conv1d.weight, self.conv1d.bias, doc_ids_BS))
        x, dt, A, Bm, Cm = self.scan_inputs(xbc, dt)
        y, _ = ssd_scan(x, dt, A, Bm, Cm, self.chunk_size, doc_ids_BS)
        return self.finish(y, x, z)
