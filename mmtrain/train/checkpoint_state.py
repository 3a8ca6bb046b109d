"""What a rank puts into a checkpoint and takes out of it, as boxes of global tensors (``mmtrain.parallel.global_chunks``).

Stored tensors (global names and shapes, so any layout reads any other's checkpoint):

=================================  ===================================================================
``model.<name>``                   weights and persistent buffers (``layers.<i>`` is the global layer index)
``optim.master.<name>``            fp32 master weights (absent with ``optim.master_weights=false``)
``optim.exp_avg.<name>``,          AdamW moments (absent before the first step)
``optim.exp_avg_sq.<name>``
``rng.<rank>.cpu|cuda``            RNG states, per rank: restored only at the saving layout
``fp8.<matmul>.amax_history``      native FP8 delayed scaling (``Fp8Runtime.delayed_state``): each FP8
``fp8.<matmul>.scales``            matmul's amax history (2, L), oldest step first, and its two scales;
                                   ``<matmul>`` is the linear (``layers.<i>.attn.qkv``, ``head``)
=================================  ===================================================================

Optimizer pieces (``MixedPrecisionAdamW.pieces``: flat ranges of a parameter shard, one per bucket owner) are
stored as boxes of the parameter they belong to, so the distributed optimizer's shards reshard like weights.
The last stage's copy of a tied embedding is not stored (it equals ``embed.weight``, and so does its AdamW
state); it loads from ``embed.weight``. Everything not a tensor (step, loader state, AdamW's step count) goes to
a small JSON file per rank (``mmtrain.train.checkpoint``). FP8 delayed-scaling state is the same on every rank
holding a matmul (its amaxes are reduced over TP and DP x CP), so it is stored whole under the matmul's name and
each rank of any layout reads the matmuls it has; a checkpoint without it starts a fresh amax history.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.global_chunks import (
    Shard,
    chunks_of,
    model_load_chunks,
    shard_of,
    stored_name,
)
from mmtrain.utils.checkpoint_marker import checksums_for
from mmtrain.utils.dcp_io import Chunk, load_chunks, saved_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")
FP8_STATE = ("amax_history", "scales")  # per FP8 matmul (Fp8Runtime.delayed_state)


def _pieces(model: torch.nn.Module, optimizer: Any):
    """(parameter name, local shape, flat range lo, piece) for every optimizer piece of this rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    for pc in optimizer.pieces:
        yield names[id(pc.param)], tuple(pc.param.shape), pc.start - pc.param.buffer_offset, pc


def _skip(name: str, spec) -> bool:
    return stored_name(name, spec) != name  # a tied copy (a tied embedding's last-stage copy)


def save_chunks_of(mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any, device: torch.device,
                   copy: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[Chunk], float | None]:
    """This rank's chunks, each value passed through ``copy`` (to host memory), and AdamW's step count."""
    spec, shard = model.sharding_spec(), shard_of(mesh)
    chunks: list[Chunk] = []
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor) and not _skip(name, spec):  # (a module's non-tensor extra state is not kept)
            chunks += chunks_of(f"model.{name}", name, tuple(t.shape), t.reshape(-1), spec, shard, copy=copy)
    adam_step = None
    for name, shape, lo, pc in _pieces(model, optimizer):
        state = optimizer.optimizer.state.get(pc.master, {})
        if "step" in state:
            adam_step = float(state["step"])
        if _skip(name, spec):
            continue
        values = {"master": pc.master} if optimizer.master_weights else {}
        values.update({k: state[k] for k in MOMENTS if k in state})
        for kind, flat in values.items():
            chunks += chunks_of(f"optim.{kind}.{name}", name, shape, flat, spec, shard, lo, copy=copy)
    fp8 = getattr(model, "fp8_runtime", None)
    for name, tensors in (fp8.delayed_state() if fp8 is not None else {}).items():
        for kind, t in tensors.items():
            chunks.append(Chunk(f"fp8.{name}.{kind}", tuple(t.shape), (0,) * t.dim(), copy(t)))
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    for kind, state in rng.items():
        chunks.append(Chunk(f"rng.{mesh.rank:05d}.{kind}", tuple(state.shape), (0,), state.clone()))
    return chunks, adam_step


@torch.no_grad()
def load_state(folder: Path, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any, device: torch.device,
               adam_step: float | None, restore_rng: bool, verify: bool = True) -> None:
    """Fill this rank's weights, fp32 masters and AdamW moments (and RNG, at the saving layout) from ``folder``,
    a checkpoint of any layout (``verify``: check its files against their checksums)."""
    spec, shard = model.sharding_spec(), shard_of(mesh)
    saved = saved_tensors(folder, verify)
    if hasattr(optimizer, "gather_full_params"):  # collective: fully sharded parameters get storage to load into
        optimizer.gather_full_params()
    chunks, missing = model_load_chunks(model.state_dict(), spec, shard, saved)
    if missing:
        raise ValueError(f"{folder}: no stored value for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    moments: list[tuple[Any, dict[str, torch.Tensor]]] = []
    masters_missing = []
    for name, shape, lo, pc in _pieces(model, optimizer):
        key = stored_name(name, spec)
        if optimizer.master_weights:
            if f"optim.master.{key}" in saved:
                chunks += chunks_of(f"optim.master.{key}", name, shape, pc.master, spec, shard, lo)
            else:
                masters_missing.append(pc)
        if f"optim.exp_avg.{key}" in saved:
            state = {k: torch.zeros_like(pc.master) for k in MOMENTS}
            for k, flat in state.items():
                chunks += chunks_of(f"optim.{k}.{key}", name, shape, flat, spec, shard, lo)
            moments.append((pc, state))
    fp8 = getattr(model, "fp8_runtime", None)
    fp8_state: dict[str, dict[str, torch.Tensor]] = {}
    if fp8 is not None and fp8.history is not None:  # native delayed scaling: what this rank's matmuls have
        for name in fp8.names:
            keys = {k: f"fp8.{name}.{k}" for k in FP8_STATE}
            if all(key in saved for key in keys.values()):
                fp8_state[name] = {k: torch.zeros(saved[key][0], dtype=saved[key][1]) for k, key in keys.items()}
                chunks += [Chunk(key, saved[key][0], (0,) * len(saved[key][0]), fp8_state[name][k])
                           for k, key in keys.items()]
    rng = {}
    if restore_rng:
        for kind in ("cpu", "cuda") if device.type == "cuda" else ("cpu",):
            key = f"rng.{mesh.rank:05d}.{kind}"
            if key in saved:
                rng[kind] = torch.zeros(saved[key][0], dtype=saved[key][1])
                chunks.append(Chunk(key, saved[key][0], (0,), rng[kind]))
    load_chunks(folder, chunks, verify)
    if hasattr(optimizer, "params_loaded"):
        optimizer.params_loaded()
    for pc in masters_missing:  # saved without fp32 masters: start them from the weights
        pc.master.copy_(pc.owner.param_values(pc.bucket, pc.start, pc.end))
    fused = bool(optimizer.optimizer.defaults.get("fused"))
    for pc, state in moments:
        optimizer.optimizer.state[pc.master] = {
            "step": torch.tensor(adam_step or 0.0, dtype=torch.float32, device=pc.master.device if fused else "cpu"),
            **{k: v.to(pc.master.device) for k, v in state.items()}}
    if fp8 is not None:
        fp8.load_delayed_state(fp8_state, str(folder), any(k.startswith("fp8.") for k in saved))
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def load_model_weights_only(folder: Path, mesh: ParallelMesh | None, model: torch.nn.Module,
                            verify: bool = True) -> None:
    """Fill only the weights of ``model`` (this rank's shard; ``mesh=None``: one process, the whole model) from
    ``folder``, a checkpoint of any layout: e.g. a VLM's stage 2 starting from stage 1, or the demo's caption."""
    shard = shard_of(mesh) if mesh is not None else Shard()
    checksums_for(folder, verify)  # checksums.json as complete.json requires it (a warning without one)
    saved = saved_tensors(folder, verify)
    chunks, missing = model_load_chunks(model.state_dict(), model.sharding_spec(), shard, saved)
    if missing:
        raise ValueError(f"{folder}: no stored value for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                         " (the model shape must be the same as the checkpoint's)")
    load_chunks(folder, chunks, verify)
