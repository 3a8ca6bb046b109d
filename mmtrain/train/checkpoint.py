"""Checkpoints of a run in ``torch.distributed.checkpoint`` (DCP) format, resumable at any parallel layout.

Folder layout under ``<run_dir>/checkpoints/``::

    step_00000100/.metadata, __0_0.distcp ...  DCP: global tensors by global name (``mmtrain.train.checkpoint_state``)
    step_00000100/rank_00000.json ...         per rank: step, layout, data loaders' states, AdamW step count
    step_00000100/checksums.json              XXH3 hash of every file above, written after .metadata (``utils/dcp_storage.py``)
    step_00000100/complete.json               written by rank 0 after every rank finished: the checkpoint counts only
                                              then; the run config, its schedule and data-order records, the
                                              format version, the hash of checksums.json and its own seal
                                              (``utils/checkpoint_marker.py``)
    latest                                    name of the newest complete checkpoint, replaced atomically, last

A crash during a save never damages an earlier checkpoint: nothing counts before ``complete.json``, and
``latest`` moves only after it. Loading reads tensors with ``torch.load(weights_only=True)`` (DCP) and DCP's
metadata through an unpickler that accepts only DCP's metadata classes; everything else is JSON. Every file
is checked against ``checksums.json`` before it is read (``checkpoint.verify``), and ``complete.json`` against its
seal; a missing or damaged file (``checksums.json`` included) stops the run with one line naming it and the
previous complete checkpoint. At another
layout, each rank reads the boxes of the global tensors it now holds (weights, fp32 masters, AdamW moments);
the loader resumes from the global sample count; RNG streams are per rank and restart only at the same layout.
With ``checkpoint.async_save`` the step waits only for a copy of this rank's tensors to (pinned) host memory;
a background thread writes them and runs DCP's collectives on a process group of its own.
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
from mmtrain.train.checkpoint_state import load_state, save_chunks_of
from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.dcp_io import Chunk, async_save_chunks, save_chunks
from mmtrain.utils.checkpoint_marker import checksums_for, read_marker, write_marker
from mmtrain.utils.dcp_storage import (
    CheckpointFormatError,
    ChecksummingFileSystemWriter,
    DamagedFileError,
    check_file,
)
from mmtrain.utils.file_checksums import entry_of_bytes
from mmtrain.utils.log import get_logger


class CheckpointError(RuntimeError):
    pass


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Parameters the optimizer holds state for (a frozen component has none): a resume must train the same."""
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


def _rank_file_for(saved_layout: dict, mesh: ParallelMesh) -> int:
    """Which saved rank's JSON this rank reads at another layout: one of the same data-parallel (and context-
    parallel) coordinate when the saved run had the same dp and cp sizes (a VLM checkpoint of earlier versions
    holds that rank's part of the media state), else rank 0's (a global loader state resumes from any)."""
    d, c = mesh.dims, mesh.coord
    if saved_layout.get("dp") == d.dp and saved_layout.get("cp") == d.cp and saved_layout.get("tp"):
        return saved_layout["tp"] * (c.cp + d.cp * c.dp)  # rank = tp + TP * (cp + CP * (dp + DP * pp)), tp = pp = 0
    return 0


def _layout(mesh: ParallelMesh) -> dict[str, int]:
    d = mesh.dims
    return {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "cp": d.cp, "dp": d.dp, "ep": d.ep}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A compact host copy (pinned when ``t`` is on the GPU; the copy is asynchronous until synchronized)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    return out.copy_(t.detach(), non_blocking=t.device.type == "cuda")


def _finalize(root: Path, folder: Path, step: int, layout: dict, keep_last: int, config: dict | None,
              records: dict | None = None) -> None:
    """Rank 0, once every rank's data is written: the marker, then ``latest``, then retention. ``records``:
    more entries of the marker (the schedule and data-order inputs: ``mmtrain.train.resume_inputs``)."""
    write_marker(folder, {
        "step": step, "layout": layout, "format": "torch.distributed.checkpoint",
        "mmtrain_version": mmtrain.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": config or {}, **(records or {})})
    atomic_write_text(Path(root) / "latest", folder.name + "\n")
    if keep_last > 0:
        done = sorted(p for p in Path(root).glob("step_*") if (p / "complete.json").exists())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """Saves checkpoints, synchronously or in a background thread (``async_save``).

    Collective: every rank calls ``save`` at the same steps. With more than one rank, the first save creates
    one gloo process group for DCP's plan exchange, so a background save never shares a communicator with
    training. At most one save is in flight: the next one (and ``close``) waits for it.

    ``async_via``: "copy" (default) — our non-blocking copies to pinned host memory, then ``dcp.save`` in a
    thread; "dcp" — ``dcp.async_save`` stages (copies to cached pinned memory) and writes in its own thread.
    ``bench/checkpoint.py`` measures both.
    """

    def __init__(self, root: Path, mesh: ParallelMesh, async_save: bool = False, timeout_s: float = 1800.0,
                 thread_count: int = 1, async_via: str = "copy") -> None:
        if async_via not in ("copy", "dcp"):
            raise ValueError(f"async_via must be 'copy' or 'dcp', got {async_via!r}")
        self.root, self.mesh, self.async_save, self.thread_count = Path(root), mesh, async_save, thread_count
        self.timeout_s, self.async_via = timeout_s, async_via
        self._dcp_writer = None
        self.group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.log = get_logger("checkpoint")
        self.last_timing: dict[str, float] = {}

    def save(self, step: int, model: torch.nn.Module, optimizer: Any, loader_state: dict, device: torch.device,
             keep_last: int = 0, config: dict | None = None, force_sync: bool = False, records: dict | None = None,
             valid_loader_state: dict | None = None) -> Path:
        self.wait()
        via_dcp = self.async_save and not force_sync and self.async_via == "dcp"
        if self.group is None and dist.is_initialized() and (dist.get_world_size() > 1 or via_dcp):
            import datetime  # created at the first save (every rank saves at the same steps), not before step 1

            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        start = time.perf_counter()
        folder = self.root / f"step_{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        if self.mesh.rank == 0:  # saving a step again (a rerun from an older checkpoint): it no longer counts
            (folder / "complete.json").unlink(missing_ok=True)  # before any rank writes (DCP's plan exchange orders it)
        # DCP's staging copies GPU tensors to host memory; host tensors it would keep as they are (no snapshot)
        staged_by_dcp = via_dcp and device.type == "cuda"
        if hasattr(optimizer, "gather_full_params"):  # collective: weights FP8-gathered (fp8.param_gather) in BF16
            optimizer.gather_full_params()
        chunks, adam_step = save_chunks_of(self.mesh, model, optimizer, device,
                                           (lambda v: v) if staged_by_dcp else _host_copy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the non-blocking copies must land before anyone reads them
        layout = _layout(self.mesh)
        try:
            extra = json.dumps({"step": step, "layout": layout, "loader": loader_state, "adam_step": adam_step,
                                "trainable": _trainable_names(model), "valid_loader": valid_loader_state})
        except TypeError as exc:
            raise CheckpointError(f"the data loader state must be plain JSON values (dict/list/str/number): {exc}") from exc
        rank_file = f"rank_{self.mesh.rank:05d}.json"
        atomic_write_text(folder / rank_file, extra)
        own_sums = {rank_file: entry_of_bytes(extra.encode("utf-8"))}  # into checksums.json with the DCP files
        future = None
        if via_dcp:  # DCP copies the values to (cached, pinned) host memory before it returns
            if self._dcp_writer is None:
                self._dcp_writer = ChecksummingFileSystemWriter(folder, thread_count=self.thread_count,
                                                                cache_staged_state_dict=staged_by_dcp)
            future = async_save_chunks(folder, chunks, self._dcp_writer, self.group, own_sums)
        blocked = time.perf_counter() - start
        args = (folder, chunks, step, layout, keep_last, config, start, blocked, future, records, own_sums)
        if not self.async_save or force_sync:
            self._write(*args)
            self.wait()
            if self.group is not None:
                dist.barrier(group=self.group)  # every rank returns after ``latest`` moved
            return folder
        self._thread = threading.Thread(target=self._write, args=args, daemon=True)
        self._thread.start()
        return folder

    def _write(self, folder: Path, chunks: list[Chunk], step: int, layout: dict, keep_last: int,
               config: dict | None, start: float, blocked: float, future=None, records: dict | None = None,
               own_sums=None) -> None:
        try:
            if future is not None:
                future.result()
            else:
                save_chunks(folder, chunks, group=self.group, no_dist=self.group is None,
                            thread_count=self.thread_count, extra_checksums=own_sums)
            self.last_timing = {"blocked_s": blocked, "total_s": time.perf_counter() - start,
                                "bytes": sum(c.tensor.numel() * c.tensor.element_size() for c in chunks)}
            if self.mesh.rank != 0:
                return
            _finalize(self.root, folder, step, layout, keep_last, config, records)
            how = (f"asynchronously: the step waited {blocked:.3f}s, the background write took "
                   if self.async_save and threading.current_thread() is self._thread else "in ")
            self.log.info(f"saved checkpoint {folder} {how}{time.perf_counter() - start:.2f}s")
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the save in flight (if any) finished; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {error}") from error

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


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object; the file is damaged")
    return value


def read_complete(folder: Path) -> dict:
    """The checkpoint's ``complete.json``, its seal checked (``mmtrain.utils.checkpoint_marker.read_marker``);
    a ``CheckpointError`` of one line naming the file (and the checkpoint to use instead) otherwise."""
    try:
        return read_marker(Path(folder))
    except DamagedFileError as exc:
        raise CheckpointError(exc.with_earlier_checkpoint()) from None
    except CheckpointFormatError as exc:
        raise CheckpointError(str(exc)) from None


def is_weights_only(folder: Path) -> bool:
    """A converted (e.g. Hugging Face) checkpoint: weights at any layout, no optimizer/loader/RNG state."""
    return bool(read_complete(folder).get("weights_only", False))


def _checksums_of(folder: Path, verify: bool) -> dict | None:
    try:
        return checksums_for(folder, verify)
    except DamagedFileError as exc:  # checksums.json missing or changed
        raise CheckpointError(exc.with_earlier_checkpoint()) from None
    except CheckpointFormatError as exc:
        raise CheckpointError(f"{exc}; set checkpoint.verify=false to load it unchecked") from None


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
                    device: torch.device, verify: bool = True) -> dict:
    """Restore this rank's state; returns {"step", "loader", "valid_loader"} (the last None when not saved). At
    the saving run's layout everything is restored bit for bit (RNG included); at another layout weights and
    optimizer state are resharded by DCP. ``verify``: check every file read against the checkpoint's
    ``checksums.json`` (``checkpoint.verify``). Any problem with the checkpoint is a ``CheckpointError`` of one line
    naming the file."""
    folder = Path(folder)
    meta = read_complete(folder)
    checksums = _checksums_of(folder, verify)
    same = meta.get("layout") == _layout(mesh)
    rank_file = folder / f"rank_{mesh.rank if same else _rank_file_for(meta.get('layout') or {}, mesh):05d}.json"
    try:
        check_file(folder, rank_file.name, checksums)
        extra = _read_json(rank_file)
        if same and "trainable" in extra and extra["trainable"] != _trainable_names(model):
            raise CheckpointError(f"{folder}: its optimizer holds other parameters than this run trains (another "
                                  "freeze list or model); to start from its weights only, use init_from (VLM runs)")
        load_state(folder, mesh, model, optimizer, device, extra.get("adam_step"), restore_rng=same, verify=verify)
    except DamagedFileError as exc:
        raise CheckpointError(exc.with_earlier_checkpoint()) from None
    except (CheckpointFormatError, ValueError) as exc:  # a shape or tensor this model does not have
        raise CheckpointError(f"cannot resume: {exc}; resume with the model config it was saved with (its "
                              "complete.json 'config'), or start a new run (another logging.run_dir)") from None
    how = "" if same else f", resharded from layout {meta['layout']} to {_layout(mesh)}"
    get_logger("checkpoint").info(f"resumed from {folder} (step {extra['step']}){how}")
    return {"step": extra["step"], "loader": extra["loader"], "valid_loader": extra.get("valid_loader")}
