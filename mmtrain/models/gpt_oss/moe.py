"""GPT-OSS's mixture of experts, for one device: a router with a bias, experts with biases and a clamped SwiGLU.

Router: ``logits = x W^T + b`` (fp32 here), the top-k logits per token, a softmax over those k only (the other
experts get no weight at all, unlike a softmax over every expert then top-k). No load-balancing loss and no
selection bias: HF's ``router_aux_loss_coef`` applies only with ``output_router_logits``, which its training
default leaves off.

Experts (``BiasedExperts``, ``mmtrain.model.moe.Experts`` with biases): ``w_up`` (E, D, 2F) holds HF's
``gate_up_proj`` as it is, gate and up *interleaved* along the last dim (columns 0, 2, 4, ... are the gate, 1, 3,
5, ... the up projection), ``b_up`` (E, 2F) likewise; ``w_down`` (E, F, D) and ``b_down`` (E, D). The activation
is GPT-OSS's: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``.

The token dispatch (``mmtrain.parallel.moe_dispatch``: local, or all-to-all over the EP group) is the shared one;
the layer is a ``RoutedExpertsLayer`` (``mmtrain.models.contract``) so the expert-parallel plan finds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config.schema import ModelConfig
from mmtrain.model.moe import Experts
from mmtrain.models.contract import RoutedExpertsLayer
from mmtrain.models.gpt_oss.config import GptOssConfig
from mmtrain.parallel.moe_dispatch import LocalDispatch, count_per_expert


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation on interleaved ``h`` = [g0, u0, g1, u1, ...] (the last dim): width halves."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class TopKSoftmaxRouter(nn.Module):
    """``weight`` (E, D) and ``bias`` (E,); returns (weights (N, k) fp32 summing to one, expert ids (N, k))."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_local_experts))

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x_ND.float(), self.weight.float(), self.bias.float())
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1), ids


def _expert_shape(cfg: GptOssConfig) -> ModelConfig:
    """The shape that makes ``moe.Experts`` hold w_up (E, D, 2F) and w_down (E, F, D)."""
    return ModelConfig(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                       moe_ffn_hidden_size=cfg.intermediate_size, activation="swiglu")


class BiasedExperts(Experts):
    """This rank's experts ``[first, first + num_local)`` of ``num_total`` (see the module docstring)."""

    def __init__(self, cfg: GptOssConfig, num_local: int, first: int = 0, num_total: int | None = None) -> None:
        super().__init__(_expert_shape(cfg), num_local, first, num_total)
        self.b_up = nn.Parameter(torch.empty(num_local, 2 * cfg.intermediate_size))
        self.b_down = nn.Parameter(torch.empty(num_local, cfg.hidden_size))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
        """``x_MD``: rows of expert 0, then expert 1, ... (``counts_E`` each), then rows of no expert (padding,
        ``valid_M`` False there; their outputs are zero), as ``Experts.forward``."""
        if self._use_grouped_gemm(x_MD):  # one grouped GEMM each way, the biases gathered per row
            ends = counts_E.cumsum(0)
            expert_of_row = torch.searchsorted(ends, torch.arange(x_MD.shape[0], device=x_MD.device), right=True)
            expert_of_row = expert_of_row.clamp(max=self.w_up.shape[0] - 1)  # padding rows: masked below
            if valid_M is not None:
                x_MD = x_MD.masked_fill(~valid_M[:, None], 0)
            offs = ends.to(torch.int32)
            h = F.grouped_mm(x_MD, self.w_up, offs=offs) + self.b_up[expert_of_row]
            if valid_M is not None:  # rows past the last group are not computed: no gradient may reach b_up
                h = h.masked_fill(~valid_M[:, None], 0)
            y = F.grouped_mm(clamped_swiglu(h, self.alpha, self.limit), self.w_down, offs=offs)
            y = y + self.b_down[expert_of_row]
            return y if valid_M is None else y.masked_fill(~valid_M[:, None], 0)
        counts = counts_E.tolist()  # the per-expert loop needs host split sizes
        rest = x_MD.shape[0] - sum(counts)
        parts = x_MD.split([*counts, rest])
        outs = [clamped_swiglu(part @ self.w_up[e] + self.b_up[e], self.alpha, self.limit) @ self.w_down[e]
                + self.b_down[e] for e, part in enumerate(parts[:-1])]
        outs.append(x_MD.new_zeros(rest, self.w_down.shape[-1]))
        return torch.cat(outs)


class GptOssMoE(nn.Module, RoutedExpertsLayer):
    """Router + experts through the token-dispatch strategy ``dispatch`` (default local), which also names the
    experts this rank holds (the only ones built). No shared experts; no balance loss; no selection bias
    (``bias_update_rate`` 0); ``step_load`` counts training tokens per expert for the logs."""

    def __init__(self, cfg: GptOssConfig, dispatch: LocalDispatch | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_local_experts
        self.dispatch = dispatch or LocalDispatch()
        self.router = TopKSoftmaxRouter(cfg)
        first, count = self.dispatch.expert_range(cfg.num_local_experts)
        self.experts = BiasedExperts(cfg, count, first, cfg.num_local_experts)
        self.step_load: torch.Tensor | None = None

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights, ids = self.router(x)
        if self.training:  # training tokens only (a count kept across compiled decode steps would be stale)
            load = count_per_expert(ids.flatten(), self.num_experts)
            self.step_load = load if self.step_load is None else self.step_load + load
        out, _ = self.dispatch(x, weights, ids, self.experts, self.num_experts)
        return out.view_as(x_BSD)
