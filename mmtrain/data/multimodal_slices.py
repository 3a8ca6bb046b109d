"""The multimodal training order: ``S`` logical slices of the data, each one energon pipeline, read in one global
order that neither the data-parallel size nor the number of worker processes changes.

Slice ``s`` is energon's ``get_train_dataset`` with ``WorkerConfig(rank=s, world_size=S, num_workers=1)``: energon
gives it ``1/S`` of every dataset's samples (its own shard slices), and it has its own shuffle, blend and packing
buffers and a random generator seeded from ``(s, data.seed)``. So slice ``s`` yields the same micro-batches
whichever process reads it. Global micro-batch ``c`` is batch ``c // S`` of slice ``c % S``, and data-parallel rank
``r`` takes micro-batch ``C + r`` of each group of ``dp`` (``C`` = micro-batches consumed by all ranks), the rule
of the text loader (``mmtrain.data.loader``). With ``S`` a multiple of ``dp`` a rank reads only the ``S / dp``
slices ``s = C + r (mod dp)``, one after the other; worker processes each own some of those slices and the rank
takes their batches in the fixed order, so workers only add speed.

The loader state is ``C`` plus each slice's energon state (buffers hold restore keys, so it is small), converted
by ``_encode_state`` to JSON-compatible values. The states of all slices, gathered over the ranks, resume the
order at any data-parallel size that divides ``S``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib
import itertools
import os
import queue
import traceback
from dataclasses import dataclass
from typing import Any

from mmtrain.data.multimodal import MultimodalSettings, MultimodalTaskEncoder


@dataclass(frozen=True)
class SliceSpec:
    """Everything that shapes a slice's stream (picklable: worker processes build their slices from it)."""

    source: Any  # energon_source(): a path string or a metadataset dict
    settings: MultimodalSettings
    num_slices: int
    micro_batch_size: int
    shuffle_buffer_size: int
    max_samples_per_sequence: int | None
    packing_buffer_size: int
    seed: int


def expected_batches(slice_index: int, num_slices: int, consumed: int) -> int:
    """Batches slice ``slice_index`` has given once global micro-batches ``0 .. consumed-1`` are consumed."""
    return max(0, (consumed - slice_index + num_slices - 1) // num_slices)


def rank_slices(consumed: int, dp_rank: int, dp_size: int, num_slices: int) -> list[int]:
    """The slices a rank reads, in the order it reads them, starting at global micro-batch ``consumed + dp_rank``."""
    first = consumed + dp_rank
    return [(first + j * dp_size) % num_slices for j in range(num_slices // dp_size)]


# ---- state codec: energon states (dicts, tuples, bytes) <-> JSON-compatible values --------------------------

def _encode_state(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _encode_state(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_state(v) for v in value]}
    if isinstance(value, list):
        return [_encode_state(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith("megatron.energon"):
        return {"__energon__": f"{type(value).__module__}:{type(value).__qualname__}",
                "fields": {f.name: _encode_state(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}}
    raise TypeError(f"energon state holds a {type(value).__name__}, which the multimodal loader state cannot store")


def _decode_state(value: Any) -> Any:
    from megatron.energon.state import FlexState

    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode_state(v) for v in value["__tuple__"])
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        if set(value) == {"__energon__", "fields"}:  # an energon state dataclass (only energon's are rebuilt)
            module, name = value["__energon__"].split(":")
            if not module.startswith("megatron.energon") or "." in name:
                raise ValueError(f"multimodal loader state names {value['__energon__']!r}, not an energon class")
            cls = getattr(importlib.import_module(module), name)
            return cls(**{k: _decode_state(v) for k, v in value["fields"].items()})
        return FlexState({k: _decode_state(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_decode_state(v) for v in value]
    return value


# ---- one slice ------------------------------------------------------------------------------------------

def _sample_loaders(dataset):
    """The energon sample loaders (one per dataset of a blend) inside a built pipeline."""
    from megatron.energon.flavors.webdataset.sample_loader import (
        WebdatasetSampleLoaderDataset,
    )

    stack = [dataset]
    while stack:
        d = stack.pop()
        if isinstance(d, WebdatasetSampleLoaderDataset):
            yield d
            continue
        inner = getattr(d, "datasets", None)
        if inner is None and getattr(d, "dataset", None) is not None:
            inner = [d.dataset]
        stack.extend(inner or [])


class _SliceStream:
    """Slice ``index`` of ``spec.num_slices``: its energon pipeline, iterated the way energon's own loader does
    (the worker config active around each step), with save/restore of its state."""

    def __init__(self, spec: SliceSpec, index: int, state: dict | None = None) -> None:
        from megatron.energon import WorkerConfig, get_train_dataset, reraise_exception

        self.index = index
        self.worker_config = WorkerConfig(rank=index, world_size=spec.num_slices, num_workers=1,
                                          seed_offset=spec.seed, global_error_handler=reraise_exception)
        self.dataset = get_train_dataset(
            spec.source, split_part="train", worker_config=self.worker_config, batch_size=spec.micro_batch_size,
            task_encoder=MultimodalTaskEncoder(spec.settings), shuffle_buffer_size=spec.shuffle_buffer_size or None,
            max_samples_per_sequence=spec.max_samples_per_sequence,
            packing_buffer_size=spec.packing_buffer_size if spec.settings.pack else None)
        for loader in _sample_loaders(self.dataset):
            offsets = loader.workers_slice_offsets[0]
            if len(offsets) <= 1:
                where = loader.join_readers[0].shard_infos[0].path.parent if loader.join_readers else "?"
                raise ValueError(f"{where}: too few samples for {spec.num_slices} slices (slice {index} is empty); "
                                 "lower media.slices (LoaderOptions.num_slices) or add samples")
        self.batches = 0
        self._iter = None
        if state is not None:
            self.batches = int(state["batches"])
            self._run(self.dataset.restore_state, _decode_state(state["energon"]))

    def _run(self, fn, *args):
        self.worker_config.worker_activate(self.batches)
        try:
            return fn(*args)
        finally:
            self.worker_config.worker_deactivate()

    def next(self):
        if self._iter is None:
            self._iter = self._run(iter, self.dataset)
        try:
            batch = self._run(next, self._iter)
        except StopIteration:
            raise RuntimeError(f"multimodal slice {self.index} ended; training datasets repeat, so this is a bug "
                               "or an empty dataset") from None
        self.batches += 1
        return batch

    def state(self) -> dict:
        return {"batches": self.batches, "energon": _encode_state(self._run(self.dataset.save_state))}


# ---- readers: the rank's slices, in the main process or in worker processes ----------------------------------

class InProcessReader:
    """Reads the rank's slices in the calling process."""

    def __init__(self, spec: SliceSpec, order: list[int], states: dict[int, dict]) -> None:
        self.streams = {s: _SliceStream(spec, s, states.get(s)) for s in order}

    def next(self, slice_index: int):
        return self.streams[slice_index].next()

    def states(self) -> dict[int, dict]:
        return {s: st.state() for s, st in self.streams.items() if st.batches > 0}

    def close(self) -> None:
        pass


def _worker_main(spec: SliceSpec, slices: list[int], states: dict, out, stop) -> None:
    """Worker process: produce the batches of its slices in the order the rank takes them, each with the state
    of its slice right after it."""
    import torch

    # One thread per worker, as torch's DataLoader does: an OpenMP pool the parent started before the fork does not
    # exist in the child, and the first parallel op would wait on it forever.
    torch.set_num_threads(1)
    parent = os.getppid()
    try:
        streams = [_SliceStream(spec, s, states.get(s)) for s in slices]
        for stream in itertools.cycle(streams):
            batch = stream.next()
            item = ("batch", stream.index, stream.batches, batch, stream.state())
            while True:
                if stop.is_set() or os.getppid() != parent:  # stopped, or the rank's process is gone
                    out.cancel_join_thread()  # exit without waiting for anyone to read what is still queued
                    return
                try:
                    out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
    except BaseException as e:  # noqa: BLE001 -- every failure goes to the main process, which raises it
        text = traceback.format_exc()
        try:
            import pickle

            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        out.put(("error", e, text))
        # Stay until stopped: the batches still queued hold tensors in shared memory that the rank can only
        # receive from a living sender.
        while not stop.wait(0.5) and os.getppid() == parent:
            pass


class WorkerPoolReader:
    """The rank's slices spread over worker processes (slice ``order[j]`` to worker ``j % workers``); batches are
    taken in the fixed order, so the result equals ``InProcessReader``'s."""

    def __init__(self, spec: SliceSpec, order: list[int], states: dict[int, dict], num_workers: int,
                 prefetch: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.order, self.num_workers = order, min(num_workers, len(order))
        self.worker_of = {s: j % self.num_workers for j, s in enumerate(order)}
        self._states = {s: states[s] for s in order if s in states}
        self._stop = ctx.Event()
        self._queues, self._procs = [], []
        for w in range(self.num_workers):
            mine = [s for s in order if self.worker_of[s] == w]
            q = ctx.Queue(maxsize=max(1, prefetch))
            p = ctx.Process(target=_worker_main, args=(spec, mine, {s: states.get(s) for s in mine}, q, self._stop),
                            daemon=True, name=f"mmtrain-mm-worker-{w}")
            p.start()
            self._queues.append(q)
            self._procs.append(p)

    def next(self, slice_index: int):
        w = self.worker_of[slice_index]
        while True:
            try:
                item = self._queues[w].get(timeout=1.0)
                break
            except queue.Empty:
                if not self._procs[w].is_alive():
                    raise RuntimeError(f"multimodal loader worker {w} (pid {self._procs[w].pid}) died with exit code "
                                       f"{self._procs[w].exitcode}; see its output above") from None
        if item[0] == "error":
            exc, text = item[1], item[2]
            exc.add_note(f"in multimodal loader worker {w}:\n{text}")
            raise exc
        _, got, _batches, batch, state = item
        if got != slice_index:
            raise RuntimeError(f"multimodal loader worker {w} gave slice {got} where slice {slice_index} was due; "
                               "this is a bug")
        self._states[got] = state
        return batch

    def states(self) -> dict[int, dict]:
        return dict(self._states)

    def close(self) -> None:
        if not self._procs:
            return
        self._stop.set()
        for q in self._queues:  # let blocked puts finish; what is dropped may fail to unpickle
            with contextlib.suppress(Exception):
                while True:
                    q.get_nowait()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for q in self._queues:
            q.close()
            q.cancel_join_thread()
        self._procs, self._queues = [], []
