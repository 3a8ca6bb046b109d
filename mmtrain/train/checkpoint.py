"""Checkpoints of a run, per rank, resumable at the same parallel layout.

Folder layout under ``<run_dir>/checkpoints/``::

    step_00000100/rank_00000.pt ...   one file per rank: its model shard, optimizer shard, loader and RNG state
    step_00000100/complete.json       written by rank 0 after every rank finished: the checkpoint counts only then
    latest                            name of the newest complete checkpoint, replaced atomically, last

Every file is written atomically, so a crash during a save never damages an earlier checkpoint, and loading
uses ``torch.load(weights_only=True)``: nothing in a checkpoint is unpickled as code.
With ``checkpoint.async_save`` the step only waits for a copy to host memory; files are written in the
background (``CheckpointWriter``). Loading at another layout reshards weights and optimizer state
(``mmtrain.train.reshard``).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mmtrain
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.train.reshard import piece_records, piece_states, reshard_optimizer
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


def _snapshot(step: int, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any, loader_state: dict,
              device: torch.device) -> dict:
    """Everything this rank saves, copied to host memory (pinned when on GPU) so training may go on at once."""
    def host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.detach().clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        return out

    state = {
        "step": step,
        "layout": _layout(mesh),
        "model": {k: host(v) for k, v in model.state_dict().items()},
        # AdamW hyper-parameters only: the moments are saved once, per piece, in "piece_state"
        "optimizer": {"param_groups": optimizer.state_dict()["param_groups"]},
        "optimizer_masters": [host(pc.master) for pc in optimizer.pieces] if optimizer.master_weights else [],
        # per piece: which parameter and which flat range of it, and its Adam state: what resharding needs
        "pieces": piece_records(model, optimizer),
        "piece_state": piece_states(optimizer, host),
        "loader": loader_state,
        "rng": _rng_state(device),
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the non-blocking copies must land before anyone reads them
    return state


def _finalize(root: Path, folder: Path, step: int, layout: dict, keep_last: int, config: dict | None) -> None:
    """Rank 0, once every rank's file is complete: the marker, then ``latest``, then retention."""
    atomic_write_text(folder / "complete.json", json.dumps({
        "step": step, "layout": layout, "mmtrain_version": mmtrain.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config or {}}, indent=1))
    atomic_write_text(Path(root) / "latest", folder.name + "\n")
    if keep_last > 0:
        done = sorted(p for p in Path(root).glob("step_*") if (p / "complete.json").exists())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """Saves checkpoints, synchronously or in a background thread (``async_save``).

    Async: the tensors are first copied to pinned host memory (the only part the step waits for), then a thread
    writes this rank's file and a ``rank_R.done`` marker; rank 0's thread waits for every marker before writing
    ``complete.json`` and ``latest``. At most one save is in flight: the next one (and ``close``) waits for it.
    """

    def __init__(self, root: Path, mesh: ParallelMesh, async_save: bool = False, timeout_s: float = 1800.0) -> None:
        self.root, self.mesh, self.async_save, self.timeout_s = Path(root), mesh, async_save, timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.log = get_logger("checkpoint")

    def save(self, step: int, model: torch.nn.Module, optimizer: Any, loader_state: dict, device: torch.device,
             keep_last: int = 0, config: dict | None = None, force_sync: bool = False) -> Path:
        self.wait()
        start = time.perf_counter()
        folder = self.root / f"step_{step:08d}"
        state = _snapshot(step, self.mesh, model, optimizer, loader_state, device)
        if not self.async_save or force_sync:
            with atomic_open(folder / f"rank_{self.mesh.rank:05d}.pt", "wb") as f:
                torch.save(state, f)
            if dist.is_initialized():
                dist.barrier()
            if self.mesh.rank == 0:
                _finalize(self.root, folder, step, state["layout"], keep_last, config)
                self.log.info(f"saved checkpoint {folder} in {time.perf_counter() - start:.2f}s")
            if dist.is_initialized():
                dist.barrier()
            return folder
        blocked = time.perf_counter() - start
        self._thread = threading.Thread(target=self._write_async, daemon=True,
                                        args=(folder, state, keep_last, config, start, blocked))
        self._thread.start()
        return folder

    def _write_async(self, folder: Path, state: dict, keep_last: int, config: dict | None, start: float,
                     blocked: float) -> None:
        try:
            with atomic_open(folder / f"rank_{self.mesh.rank:05d}.pt", "wb") as f:
                torch.save(state, f)
            atomic_write_text(folder / f"rank_{self.mesh.rank:05d}.done", "")
            if self.mesh.rank != 0:
                return
            deadline = time.monotonic() + self.timeout_s
            world = self.mesh.dims.world_size
            while sum(1 for _ in folder.glob("rank_*.done")) < world:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{folder}: waited {self.timeout_s:.0f}s for all {world} ranks' files")
                time.sleep(0.05)
            _finalize(self.root, folder, state["step"], state["layout"], keep_last, config)
            for marker in folder.glob("rank_*.done"):
                marker.unlink(missing_ok=True)
            self.log.info(f"saved checkpoint {folder} asynchronously: the step waited {blocked:.3f}s, the "
                          f"background write took {time.perf_counter() - start:.2f}s")
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the save in flight (if any) finished; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"asynchronous checkpoint save failed: {error}") from error

    close = wait


def save_checkpoint(root: Path, step: int, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any,
                    loader_state: dict, device: torch.device, keep_last: int = 0,
                    config: dict | None = None) -> Path:
    """Synchronous save (collective: every rank calls it). Returns the checkpoint folder."""
    return CheckpointWriter(root, mesh).save(step, model, optimizer, loader_state, device, keep_last, config)


def _complete_in(root: Path) -> Path | None:
    if (root / "complete.json").exists():
        return root
    latest = root / "latest"
    if latest.exists():
        folder = root / latest.read_text().strip()
        if (folder / "complete.json").exists():
            return folder
        raise CheckpointError(f"{latest} names {folder}, which is not a complete checkpoint")
    return None


def is_weights_only(folder: Path) -> bool:
    """A converted (e.g. Hugging Face) checkpoint: weights at any layout, no optimizer/loader/RNG state."""
    return bool(json.loads((folder / "complete.json").read_text()).get("weights_only", False))


def _load_resharded(folder: Path, meta: dict, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any) -> dict:
    from mmtrain.convert.checkpoint_io import load_model_weights

    if meta.get("config", {}).get("parallel", {}).get("virtual_pp", 1) != 1:
        raise CheckpointError(f"{folder}: resharding a checkpoint saved with virtual pipeline stages is not supported")
    load_model_weights(folder, mesh, model, run_model_cfg=model.cfg)
    reshard_optimizer(folder, mesh, model, optimizer)
    rank0 = torch.load(folder / "rank_00000.pt", map_location="cpu", weights_only=True)
    get_logger("checkpoint").info(f"resumed from {folder} (step {rank0['step']}), resharded from layout "
                                  f"{meta['layout']} to {_layout(mesh)}")
    return {"step": rank0["step"], "loader": rank0["loader"]}


def find_checkpoint(load: str, run_dir: str) -> Path | None:
    """What a run resumes from: ``load`` if given (a step folder, or a root with ``latest``), else
    run_dir/checkpoints/latest. A run started from weights-only ``load`` resumes its own checkpoints once it has
    some, so restarting with the same config continues instead of starting over."""
    own = _complete_in(Path(run_dir) / "checkpoints")
    if not load:
        return own
    target = _complete_in(Path(load))
    if target is None:
        raise CheckpointError(f"checkpoint.load={load}: no complete checkpoint there (no complete.json or latest)")
    if own is not None and is_weights_only(target):
        return own
    return target


@torch.no_grad()
def load_checkpoint(folder: Path, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any,
                    device: torch.device) -> dict:
    """Restore this rank's state; returns {"step", "loader"}. At the saving run's layout everything is restored
    bit for bit; at another layout weights and optimizer state are resharded (``mmtrain.train.reshard``)."""
    meta = json.loads((folder / "complete.json").read_text())
    if meta["layout"] != _layout(mesh):
        return _load_resharded(folder, meta, mesh, model, optimizer)
    state = torch.load(folder / f"rank_{mesh.rank:05d}.pt", map_location="cpu", weights_only=True)
    if state.get("pieces") is not None and state["pieces"] != piece_records(model, optimizer):
        raise CheckpointError(f"{folder}: its optimizer holds other parameters than this run trains (another "
                              "freeze list or model); to start from its weights only, use init_from (VLM runs)")
    own = model.state_dict()
    for name, value in state["model"].items():
        own[name].copy_(value)
    fused = bool(optimizer.optimizer.defaults.get("fused"))
    for pc, piece_state in zip(optimizer.pieces, state["piece_state"]):
        if piece_state:
            optimizer.optimizer.state[pc.master] = {
                k: v.to("cpu" if k == "step" and not fused else pc.master.device) for k, v in piece_state.items()}
    for pc, master in zip(optimizer.pieces, state["optimizer_masters"]):
        pc.master.copy_(master)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
    get_logger("checkpoint").info(f"resumed from {folder} (step {state['step']})")
    return {"step": state["step"], "loader": state["loader"]}
