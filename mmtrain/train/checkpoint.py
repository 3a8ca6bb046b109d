"""Checkpoints of a run, per rank, resumable at the same parallel layout.

Folder layout under ``<run_dir>/checkpoints/``::

    step_00000100/rank_00000.pt ...   one file per rank: its model shard, optimizer shard, loader and RNG state
    step_00000100/complete.json       written by rank 0 after every rank finished: the checkpoint counts only then
    latest                            name of the newest complete checkpoint, replaced atomically, last

Every file is written atomically, so a crash during a save never damages an earlier checkpoint, and loading
uses ``torch.load(weights_only=True)``: nothing in a checkpoint is unpickled as code.
(Resharding to another layout and asynchronous saves belong to the checkpoint issue.)
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mmtrain
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.utils.atomic import atomic_open, atomic_write_text
from mmtrain.utils.log import get_logger


class CheckpointError(RuntimeError):
    pass


def _layout(mesh: ParallelMesh) -> dict[str, int]:
    d = mesh.dims
    return {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp, "ep": d.ep}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(root: Path, step: int, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any,
                    loader_state: dict, device: torch.device, keep_last: int = 0,
                    config: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder."""
    start = time.perf_counter()
    folder = Path(root) / f"step_{step:08d}"
    state = {
        "step": step,
        "layout": _layout(mesh),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "optimizer_masters": [pc.master.detach().cpu() for pc in optimizer.pieces] if optimizer.master_weights else [],
        "loader": loader_state,
        "rng": _rng_state(device),
    }
    with atomic_open(folder / f"rank_{mesh.rank:05d}.pt", "wb") as f:
        torch.save(state, f)
    if dist.is_initialized():
        dist.barrier()
    if mesh.rank == 0:
        atomic_write_text(folder / "complete.json", json.dumps({
            "step": step, "layout": _layout(mesh), "mmtrain_version": mmtrain.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config or {}}, indent=1))
        atomic_write_text(Path(root) / "latest", folder.name + "\n")
        if keep_last > 0:
            done = sorted(p for p in Path(root).glob("step_*") if (p / "complete.json").exists())
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        get_logger("checkpoint").info(f"saved checkpoint {folder} in {time.perf_counter() - start:.2f}s")
    if dist.is_initialized():
        dist.barrier()
    return folder


def find_checkpoint(load: str, run_dir: str) -> Path | None:
    """``load`` if given (a step folder or a checkpoints root with ``latest``), else run_dir/checkpoints/latest."""
    root = Path(load) if load else Path(run_dir) / "checkpoints"
    if (root / "complete.json").exists():
        return root
    latest = root / "latest"
    if latest.exists():
        folder = root / latest.read_text().strip()
        if (folder / "complete.json").exists():
            return folder
        raise CheckpointError(f"{latest} names {folder}, which is not a complete checkpoint")
    if load:
        raise CheckpointError(f"checkpoint.load={load}: no complete checkpoint there (no complete.json or latest)")
    return None


@torch.no_grad()
def load_checkpoint(folder: Path, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any,
                    device: torch.device) -> dict:
    """Restore this rank's state; returns {"step", "loader"}. The layout must match the saving run's."""
    meta = json.loads((folder / "complete.json").read_text())
    if meta["layout"] != _layout(mesh):
        raise CheckpointError(f"{folder} was saved with layout {meta['layout']}, this run is {_layout(mesh)}; "
                              "loading into another layout (resharding) is not supported yet")
    state = torch.load(folder / f"rank_{mesh.rank:05d}.pt", map_location="cpu", weights_only=True)
    own = model.state_dict()
    for name, value in state["model"].items():
        own[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    for pc, master in zip(optimizer.pieces, state["optimizer_masters"]):
        pc.master.copy_(master)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
    get_logger("checkpoint").info(f"resumed from {folder} (step {state['step']})")
    return {"step": state["step"], "loader": state["loader"]}
