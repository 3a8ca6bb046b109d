"""Expert parallelism: each rank of the ``ep`` group holds ``num_experts / ep`` experts; tokens travel to
their experts and back with all-to-all (``mmtrain.parallel.moe_dispatch``).

``expert_dispatch(ep_group, ...)`` makes the token-dispatch strategy an MoE layer takes at construction
(``LocalDispatch`` at EP 1, ``AllToAllDispatch`` over the group otherwise). The strategy names the experts this
rank holds (``expert_range``): the layer builds only those, and the model's ``init_weights`` gives them the
whole model's values for them, so every layout starts from the same weights. ``apply_expert_parallel`` only
checks a built model against the group; nothing is swapped in.

Expert weights are replicated over the ``edp`` group (the ranks holding the same experts), so their gradients
are reduced there, not over all data-parallel ranks (``GradBuckets`` per group, see ``mmtrain.train.loop``).
Experts are not split over tensor parallelism (Megatron's expert-TP = 1): with TP the MoE input is replicated
(or, with sequence parallelism, sequence-sharded, and then expert/router gradients are summed over TP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.models.contract import RoutedExpertsLayer
from mmtrain.parallel.moe_dispatch import AllToAllDispatch, LocalDispatch


def expert_dispatch(ep_group, token_groups: list = (), padded: bool = False,
                    overlap_shared: bool = False) -> LocalDispatch:
    """The token-dispatch strategy for MoE layers on this rank: local at EP 1, all-to-all over ``ep_group``
    otherwise (``padded``: fixed worst-case splits, no host sync; ``overlap_shared``: shared experts run while
    the tokens travel, and their backward while the output gradients travel back). ``token_groups``: the groups a micro-batch's tokens are split over (TP under sequence
    parallelism, CP), for the balance loss."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return LocalDispatch(token_groups)
    return AllToAllDispatch(ep_group, token_groups, padded=padded, overlap_side_work=overlap_shared)


def apply_expert_parallel(model: nn.Module, group) -> nn.Module:
    """Check that ``model`` was built for expert parallelism over ``group``: every MoE layer took
    ``expert_dispatch(group, ...)`` at construction, so it holds only this rank's experts (initialized as the
    whole model's slice) and routes over the group. Which group reduces the expert gradients (``edp``), and that
    they are partial over TP under sequence parallelism, is the sharding spec's business (``mmtrain.train.grads``);
    nothing on the model is changed here."""
    ep = dist.get_world_size(group) if group is not None else 1
    for name, module in model.named_modules():
        dispatch = module.dispatch if isinstance(module, RoutedExpertsLayer) else None
        if dispatch is not None and dispatch.ep_size != ep:
            raise ValueError(f"{name}: built with a token dispatch over {dispatch.ep_size} expert-parallel ranks, "
                             f"but parallel.ep={ep}; build the model with expert_dispatch(mesh.ep_group)")
    return model


@torch.no_grad()
def update_router_biases(model: nn.Module, groups: list) -> dict[str, torch.Tensor]:
    """After a step: sum each MoE layer's expert load over ``groups`` (ranks that saw different tokens),
    nudge the selection bias (``router.expert_bias``) of layers with a ``bias_update_rate`` toward balance
    (DeepSeek-V3's auxiliary-loss-free balancing), and return the loads for logging (float
    tensors on the device, read at logging steps only: no host sync here)."""
    loads = {}
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExpertsLayer) or module.step_load is None:
            continue
        load = module.step_load.float()
        for g in groups:
            if g is not None and dist.get_world_size(g) > 1:
                dist.all_reduce(load, group=g)
        rate = module.bias_update_rate  # the layer's own: 0 for routers without a selection bias
        if rate:
            module.router.expert_bias += rate * torch.sign(load.mean() - load)
        loads[name] = load
        module.step_load = None
    return loads
