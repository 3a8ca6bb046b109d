"""Transformer Engine backend of FP8 training: the FP8 blocks' linears become ``te.Linear`` modules inside TE's
fp8 autocast. Transformer Engine itself is imported only when this backend runs; CPU CI never imports it.

Names and checkpoints: each ``te.Linear`` replaces one of our linears *in place* and holds the same
``weight``/``bias`` parameters (this rank's shard, copied from ours), so parameter names, checkpoints, resharding
and the Hugging Face conversion are the same as in BF16. TE's FP8 metadata (its ``_extra_state``) is left out
of the state dict: a resumed run restarts its amax history, as the native backend does.

Tensor/sequence parallelism: TE's own TP mode assumes Megatron's [S, B, H] layout (its sequence-parallel
gather is along the first dimension); ours is [B, S, H]. So each TE linear runs on this rank's shard with
``parallel_mode=None`` and our autograd collectives wrap it exactly as in ``ColumnParallelLinear`` /
``RowParallelLinear``; TE gets the TP group only to reduce amaxes (one scale per logical tensor).

The whole forward of each model chunk runs inside ``te.autocast`` (``te.fp8_autocast`` on older TE), so TE's
delayed-scaling amax reduction happens once per forward; backward uses the recipe captured in forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.config.schema import GPTRunConfig
from mmtrain.parallel.comm import (
    copy_to_group,
    gather_seq,
    reduce_from_group,
    reduce_scatter_seq,
)

_TE_LINEAR = None


def te_recipe(cfg: GPTRunConfig):
    """The TE recipe object of ``cfg.fp8``."""
    from transformer_engine.common import recipe as R

    f = cfg.fp8
    fmt = R.Format.HYBRID if f.format == "hybrid" else R.Format.E4M3
    if f.recipe == "delayed":
        return R.DelayedScaling(margin=f.margin, fp8_format=fmt, amax_history_len=f.amax_history_len,
                                amax_compute_algo=f.amax_compute_algo)
    if f.recipe == "tensorwise":
        return R.Float8CurrentScaling(fp8_format=fmt)
    if f.recipe == "blockwise":
        return R.Float8BlockScaling(fp8_format=fmt)
    if f.recipe == "mxfp8":
        return R.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"fp8.recipe={f.recipe} has no Transformer Engine recipe")


def _te_autocast(recipe, group):
    """TE's FP8 context: ``te.autocast`` (TE >= 2.8) or the older ``te.fp8_autocast``."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


def _te_linear_class():
    global _TE_LINEAR
    if _TE_LINEAR is not None:
        return _TE_LINEAR
    import transformer_engine.pytorch as te

    class TeLinear(te.Linear):
        """``te.Linear`` on this rank's shard with our TP/SP collectives around it (see the module docstring)."""

        # keep TE's FP8 metadata out of state_dict(): same keys as the BF16 model
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            role, group, sp = self.mm_tp_role, self.mm_tp_group, self.mm_sequence_parallel
            if role == "column":
                x = gather_seq(x, group) if sp else copy_to_group(x, group)
            y = super().forward(x)
            if role == "row":
                y = reduce_scatter_seq(y, group) if sp else reduce_from_group(y, group)
            return y

    _TE_LINEAR = TeLinear
    return TeLinear


def _tp_role(lin: nn.Module) -> str | None:
    name = type(lin).__name__
    return {"ColumnParallelLinear": "column", "RowParallelLinear": "row"}.get(name)


@torch.no_grad()
def _make_te_linear(lin: nn.Module) -> nn.Module:
    """A TE linear holding the same values as ``lin`` (nn.Linear or a TP linear)."""
    role = _tp_role(lin)
    out_f, in_f = lin.weight.shape
    has_bias = lin.bias is not None
    new = _te_linear_class()(in_f, out_f, bias=has_bias, params_dtype=lin.weight.dtype, device="cuda")
    new.weight.copy_(lin.weight)
    if has_bias:
        new.bias.copy_(lin.bias)
    if hasattr(lin, "part_sizes"):
        new.part_sizes = lin.part_sizes
    new.mm_tp_role = role
    new.mm_tp_group = getattr(lin, "group", None)
    new.mm_sequence_parallel = bool(getattr(lin, "sequence_parallel", False))
    return new


def apply_te_fp8(model: nn.Module, cfg: GPTRunConfig, mesh, linears: list[tuple[nn.Module, str, nn.Module]]
                 ) -> None:
    """Swap ``linears`` (``(parent, attribute, linear)`` of this chunk: ``fp8.fp8_linears``) for TE ones and run
    the chunk's forward inside TE's FP8 autocast."""
    for parent, name, lin in linears:
        setattr(parent, name, _make_te_linear(lin))
    group = mesh.tp_group if dist.get_world_size(mesh.tp_group) > 1 else None
    recipe = te_recipe(cfg)
    inner = model.forward

    def forward_in_fp8_autocast(*args, **kwargs):
        with _te_autocast(recipe, group):
            return inner(*args, **kwargs)

    model.forward = forward_in_fp8_autocast
