"""``FusedAdamW``: AdamW through torch's fused kernel (``torch._fused_adamw_``), without ``torch.optim``.

Why not ``torch.optim.AdamW(fused=True)``: torch wraps its optimizers' constructor, ``step`` and state methods in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` (1.1-1.7 s in every training process). This
class keeps the same per-parameter state and makes the same calls in the same order as torch 2.11's fused
AdamW (steps += 1, the kernel, steps -= found_inf), so its updates are bit-identical
(``tests/unit/test_fused_adamw.py``). It does only what ``MixedPrecisionAdamW`` needs: no amsgrad, maximize,
closures, tensor learning rates or hooks.
"""

from __future__ import annotations

import torch


class FusedAdamW:
    """AdamW (decoupled weight decay) over ``param_groups``, a list of dicts with ``"params"`` and optionally
    ``"lr"``, ``"betas"``, ``"eps"``, ``"weight_decay"`` (and any other keys, kept: e.g. ``"lr_scale"``).
    ``state[param]`` is ``{"step", "exp_avg", "exp_avg_sq"}``, made at a parameter's first step: ``step`` a
    0-dim float32 tensor on the parameter's device, as torch's fused AdamW keeps it."""

    def __init__(self, groups: list[dict], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        # "fused": the state layout is fused AdamW's (checkpoint loading reads it to place "step")
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "fused": True}
        self.param_groups: list[dict] = []
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        seen: set[int] = set()
        for group in groups:
            group = {**self.defaults, **group, "params": list(group["params"])}
            b1, b2 = group["betas"]
            if not (group["lr"] >= 0 and group["eps"] >= 0 and group["weight_decay"] >= 0
                    and 0 <= b1 < 1 and 0 <= b2 < 1):
                raise ValueError(f"FusedAdamW: invalid lr, eps, weight_decay or betas in {_settings(group)}")
            for p in group["params"]:
                if not torch.is_floating_point(p):  # (complex parameters are not floating point either)
                    raise TypeError(f"FusedAdamW: parameters must be real floating point, not {p.dtype}")
                if id(p) in seen:
                    raise ValueError("FusedAdamW: a parameter appears in more than one group")
                seen.add(id(p))
            self.param_groups.append(group)

    def _state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state.get(p)
        if not state:
            state = self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return state

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """One update of every parameter with a ``.grad``. ``grad_scale`` (0-dim float32 tensor): the kernel
        divides the gradients by it (and writes them back divided). ``found_inf`` (0-dim float32 tensor,
        0 or 1): at 1 the kernel leaves weights and moments alone and the step count is put back."""
        for group in self.param_groups:
            # the kernel takes lists of one device and dtype (the same split as torch's)
            lists: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("FusedAdamW: sparse gradients are not supported")
                    lists.setdefault((p.device, p.dtype), []).append(p)
            beta1, beta2 = group["betas"]
            for (device, _), params in lists.items():
                states = [self._state_of(p) for p in params]
                steps = [s["step"] for s in states]
                scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
                skip = found_inf.to(device, non_blocking=True) if found_inf is not None else None
                torch._foreach_add_(steps, 1)  # the kernel's bias correction uses the new count
                torch._fused_adamw_(
                    params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
                    beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                    grad_scale=scale, found_inf=skip)
                if skip is not None:  # a skipped step does not count
                    torch._foreach_sub_(steps, [skip] * len(steps))

    def state_dict(self) -> dict:
        """torch's optimizer layout: ``state`` and each group's ``params`` by parameter index (tensors shared)."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index},
                "param_groups": [{**g, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
