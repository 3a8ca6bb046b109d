"""Mixture of experts, for one device: router, experts (grouped GEMM), optional shared expert, MoE layer.

The layer hands (tokens, routing) to its token-dispatch strategy, taken at construction
(``mmtrain.parallel.moe_dispatch``): ``LocalDispatch`` (the default) runs every expert here, the
expert-parallel ``AllToAllDispatch`` sends tokens to the ranks holding their experts (the EP plan then keeps
only this rank's experts). The dispatch also runs the shared expert, so it can overlap it with the all-to-all.
Routing runs in fp32. Auxiliary losses (load balancing, z-loss) are added through the gradient
(``_AttachAuxLoss``) in *sum form* — N·loss for a micro-batch of N tokens — so the trainer's "sum of token losses
/ global tokens" normalization turns them into a token-weighted mean. When a micro-batch's tokens are split over
ranks (sequence or context parallelism), the dispatch's ``token_groups`` names those groups: expert loads are summed over them
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
from mmtrain.models.contract import RoutedExpertsLayer
from mmtrain.parallel.moe_dispatch import LocalDispatch, count_per_expert


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
            balance_probs = probs
        else:
            scores = logits.sigmoid()
            ids = (scores + self.expert_bias).topk(c.moe_top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            balance_probs = scores / scores.sum(dim=-1, keepdim=True)
        if c.moe_norm_topk_prob:  # Mixtral always; Qwen3-MoE as its config says
            weights = weights / weights.sum(dim=-1, keepdim=True)
        load = count_per_expert(ids.flatten(), c.num_experts)
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
    """This rank's expert MLPs — experts ``[first, first + num_local)`` of ``num_total`` — stored stacked:
    w_up (E_local, D, 2F|F), w_down (E_local, F, D)."""

    def __init__(self, cfg: ModelConfig, num_local: int, first: int = 0, num_total: int | None = None) -> None:
        super().__init__()
        self.first, self.num_total = first, num_total or num_local
        self.gated = cfg.activation == "swiglu"
        f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.w_up = nn.Parameter(torch.empty(num_local, cfg.hidden_size, f * (2 if self.gated else 1)))
        self.w_down = nn.Parameter(torch.empty(num_local, f, cfg.hidden_size))
        self.grouped_gemm = cfg.moe_grouped_gemm

    def own_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole-model tensor (experts on dim 0): what init draws from."""
        return full.narrow(0, self.first, self.w_up.shape[0])

    def _use_grouped_gemm(self, x_MD: torch.Tensor) -> bool:
        """torch's grouped GEMM: bf16 on CUDA 9.0+, or the CPU; rows of 16-byte multiples (its stride rule)."""
        if not self.grouped_gemm or not hasattr(F, "grouped_mm"):
            return False
        if any(n * x_MD.element_size() % 16 for n in (x_MD.shape[-1], self.w_down.shape[1])):
            return False
        if x_MD.is_cuda:
            return x_MD.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_MD.device)[0] >= 9
        return x_MD.device.type == "cpu"

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
        """``x_MD`` holds the rows of expert 0, then expert 1, ... (``counts_E`` of each, a device tensor), then
        rows of no expert (padding, dropped assignments; ``valid_M`` False there), whose outputs are zero."""
        if self._use_grouped_gemm(x_MD):  # group offsets stay on the device: no host read
            offs = counts_E.cumsum(0).to(torch.int32)
            if valid_M is not None:  # rows past the last group are never computed: keep their gradients zero
                x_MD = x_MD.masked_fill(~valid_M[:, None], 0)
            h = swiglu_or_gelu(F.grouped_mm(x_MD, self.w_up, offs=offs), self.gated)
            y = F.grouped_mm(h, self.w_down, offs=offs)
            return y if valid_M is None else y.masked_fill(~valid_M[:, None], 0)
        counts = counts_E.tolist()  # the per-expert loop needs host split sizes (a device read on a GPU)
        rest = x_MD.shape[0] - sum(counts)
        parts = x_MD.split([*counts, rest])
        outs = [swiglu_or_gelu(part @ self.w_up[e], self.gated) @ self.w_down[e] for e, part in enumerate(parts[:-1])]
        outs.append(x_MD.new_zeros(rest, self.w_down.shape[-1]))
        return torch.cat(outs)


def _capacity_mask(ids_NK: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor | None:
    """Which assignments fit their expert's capacity (first come, first served); None when dropless."""
    if not capacity_factor:
        return None
    capacity = math.ceil(capacity_factor * ids_NK.numel() / num_experts)
    flat = ids_NK.flatten()
    order = flat.argsort(stable=True)  # by expert, in (token, k) order inside each: the arrival order
    counts = count_per_expert(flat, num_experts)
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    position = torch.empty_like(flat).scatter_(0, order, rank_in_expert)
    return (position < capacity).view_as(ids_NK)


class MoELayer(nn.Module, RoutedExpertsLayer):
    """Routed experts (softmax / sigmoid router, capacity, aux + z losses) plus optional shared experts; a
    ``RoutedExpertsLayer`` (``mmtrain.models.contract``: how the expert-parallel plan finds it)."""

    def __init__(self, cfg: ModelConfig, dispatch: LocalDispatch | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.dispatch = dispatch or LocalDispatch()  # a strategy object (mmtrain.parallel.moe_dispatch)
        self.router = _Router(cfg)
        first, count = self.dispatch.expert_range(cfg.num_experts)  # only this rank's experts (local: all)
        self.experts = Experts(cfg, count, first, cfg.num_experts)
        self.shared = None
        if cfg.moe_shared_ffn_hidden_size:
            shared_cfg = type(cfg)(**{**cfg.__dict__, "ffn_hidden_size": cfg.moe_shared_ffn_hidden_size})
            self.shared = MLP(shared_cfg)
        self.step_load: torch.Tensor | None = None  # tokens per expert, accumulated over a step (for logs/bias)

    @property
    def bias_update_rate(self) -> float:
        """Per-step change of the selection bias toward balance (``update_router_biases``); 0: no bias."""
        return self.cfg.moe_bias_update_rate if self.cfg.moe_router == "sigmoid" else 0.0

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        shape = x_BSD.shape
        x = x_BSD.reshape(-1, shape[-1])
        weights, ids, aux, load = self.router(x, self.dispatch.token_groups)
        if self.training:  # the bias update counts training tokens only (not validation, a DPO reference or
            # decoding, where a count kept across compiled steps would hold a CUDA graph's overwritten output)
            self.step_load = load if self.step_load is None else self.step_load + load
        keep = _capacity_mask(ids, self.cfg.num_experts, self.cfg.moe_capacity_factor)
        out, shared_out = self.dispatch(x, weights, ids, self.experts, self.cfg.num_experts, keep, self.shared)
        if shared_out is not None:
            out = out + shared_out
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, 1.0)
        return out.view(shape)
