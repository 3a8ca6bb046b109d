"""Mixture of experts, for one device: router, experts (grouped GEMM), optional shared expert, MoE layer.

The layer hands (tokens, routing) to ``self.dispatch``; the default runs every expert locally. The expert-
parallel plan (``mmtrain.parallel.expert``) keeps only this rank's experts and swaps in an all-to-all dispatch.
Routing runs in fp32. Auxiliary losses (load balancing, z-loss) are added through the gradient
(``_AttachAuxLoss``) in *sum form* — N·loss for a micro-batch of N tokens — so the trainer's "sum of token losses
/ global tokens" normalization turns them into a token-weighted mean. When a micro-batch's tokens are split over
ranks (sequence or context parallelism), ``token_groups`` names those groups: expert loads are summed over them
so the balance loss sees the whole micro-batch, and each rank contributes the gradient of its own tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmtrain.config.schema import ModelConfig
from mmtrain.model.mlp import MLP, swiglu_or_gelu
from mmtrain.parallel.expert import permute_by_expert, unpermute_and_combine


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward also sends gradient ``scale`` into ``aux_loss``."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class _Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # sigmoid routing: a per-expert bias used only to *select* experts, nudged toward balance (no gradient)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x_ND: torch.Tensor, token_groups: list = ()):
        """Returns (weights (N, k) fp32, expert ids (N, k), auxiliary loss in sum form, tokens per expert (E,))."""
        c = self.cfg
        logits = F.linear(x_ND.float(), self.weight.float())
        if c.moe_router == "softmax":
            probs = logits.softmax(dim=-1)
            weights, ids = probs.topk(c.moe_top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            balance_probs = probs
        else:
            scores = logits.sigmoid()
            ids = (scores + self.expert_bias).topk(c.moe_top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            balance_probs = scores / scores.sum(dim=-1, keepdim=True)
        load = torch.bincount(ids.flatten(), minlength=c.num_experts)
        aux = logits.new_zeros(())
        if c.moe_aux_loss_coeff:  # Switch balance loss E * sum_i f_i * P_i, times the tokens of the micro-batch
            full_load = load.float()
            for g in token_groups:
                full_load = full_load.clone()
                dist.all_reduce(full_load, group=g)
            fraction = full_load / full_load.sum()
            aux = aux + c.moe_aux_loss_coeff * c.num_experts * (fraction * balance_probs.sum(dim=0)).sum()
        if c.moe_z_loss_coeff:
            aux = aux + c.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum()
        return weights, ids, aux, load


class Experts(nn.Module):
    """``num_local`` expert MLPs stored stacked: w_up (E, D, 2F|F), w_down (E, F, D)."""

    def __init__(self, cfg: ModelConfig, num_local: int) -> None:
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.w_up = nn.Parameter(torch.empty(num_local, cfg.hidden_size, f * (2 if self.gated else 1)))
        self.w_down = nn.Parameter(torch.empty(num_local, f, cfg.hidden_size))
        self.grouped_gemm = cfg.moe_grouped_gemm

    def forward(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x_MD`` holds the tokens of expert 0, then expert 1, ... (``counts`` of each)."""
        use_grouped = (self.grouped_gemm and x_MD.is_cuda and x_MD.dtype == torch.bfloat16
                       and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x_MD.device)[0] >= 9)
        if use_grouped:
            offs = torch.tensor(counts, device=x_MD.device).cumsum(0).to(torch.int32)
            h = swiglu_or_gelu(torch._grouped_mm(x_MD, self.w_up, offs=offs), self.gated)
            return torch._grouped_mm(h, self.w_down, offs=offs)
        outs = []
        for e, part in enumerate(x_MD.split(counts)):
            outs.append(swiglu_or_gelu(part @ self.w_up[e], self.gated) @ self.w_down[e])
        return torch.cat(outs) if outs else x_MD.new_zeros(0, self.w_down.shape[-1])


def _capacity_mask(ids_NK: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor | None:
    """Which assignments fit their expert's capacity (first come, first served); None when dropless."""
    if not capacity_factor:
        return None
    capacity = math.ceil(capacity_factor * ids_NK.numel() / num_experts)
    onehot = F.one_hot(ids_NK.flatten(), num_experts)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
    return (position < capacity).view_as(ids_NK)


def local_dispatch(x_ND: torch.Tensor, weights_NK: torch.Tensor, ids_NK: torch.Tensor, experts: Experts,
                   num_experts: int, keep_NK: torch.Tensor | None = None) -> torch.Tensor:
    """Sort assignments by expert, run the experts, scatter back and combine with the routing weights (every
    expert on this device; ``mmtrain.parallel.expert``'s all-to-all dispatch has the same signature)."""
    order, counts = permute_by_expert(ids_NK, num_experts, keep_NK)
    counts = counts.tolist()
    kept = sum(counts[:num_experts])
    y_sorted = experts(x_ND[order[:kept] // ids_NK.shape[1]], counts[:num_experts])
    return unpermute_and_combine(y_sorted, order, weights_NK, x_ND)


class MoELayer(nn.Module):
    is_moe_layer = True  # how the expert-parallel plan finds these layers without importing model code

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = _Router(cfg)
        self.experts = Experts(cfg, cfg.num_experts)
        self.shared = None
        if cfg.moe_shared_ffn_hidden_size:
            shared_cfg = type(cfg)(**{**cfg.__dict__, "ffn_hidden_size": cfg.moe_shared_ffn_hidden_size})
            self.shared = MLP(shared_cfg)
        self.dispatch = local_dispatch  # replaced by the expert-parallel plan
        self.token_groups: list = []  # groups over which one micro-batch's tokens are split (SP, CP)
        self.step_load: torch.Tensor | None = None  # tokens per expert, accumulated over a step (for logs/bias)

    @property
    def bias_update_rate(self) -> float:
        """Per-step change of the selection bias toward balance (``update_router_biases``); 0: no bias."""
        return self.cfg.moe_bias_update_rate if self.cfg.moe_router == "sigmoid" else 0.0

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        shape = x_BSD.shape
        x = x_BSD.reshape(-1, shape[-1])
        weights, ids, aux, load = self.router(x, self.token_groups)
        self.step_load = load if self.step_load is None else self.step_load + load
        keep = _capacity_mask(ids, self.cfg.num_experts, self.cfg.moe_capacity_factor)
        out = self.dispatch(x, weights, ids, self.experts, self.cfg.num_experts, keep)
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, 1.0)
        return out.view(shape)
