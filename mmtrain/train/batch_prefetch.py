"""``PrefetchedBatches``: a batch source's next batches built ahead of the step by one background thread.

Without it the step builds its own micro-batches (token rows, images, collation) while the GPU, whose queue the
previous step left short, waits. The thread calls the source's ``next()`` in order (the batches and their order
are the source's own), takes the source's ``snapshot()`` right after each, optionally copies the batch into
page-locked memory (so the step's ``to(device, non_blocking=True)`` overlaps the GPU's work), and hands them over
through a queue of ``depth`` batches. ``state_dict()`` is the source's state at the snapshot of the last batch the
step *took*, not of the ones built ahead, so a resume continues exactly after what was trained on.

An error in the source reaches the step unchanged (same exception, same one-line message) at the batch it stopped
at; ``close()`` stops and joins the thread (also when the step failed).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

_POLL_S = 0.1  # how often a blocked put/get looks whether it should stop


class PrefetchedBatches:
    """``next()`` / ``state_dict()`` / ``load_state_dict()`` of ``source`` (which also has ``snapshot()`` and
    ``state_dict(snapshot)``, as ``VLMBatches``), with up to ``depth`` batches built ahead; ``pin_device``: a CUDA
    device to pin the batches for (their ``pin_memory()``), None to leave them as built."""

    def __init__(self, source, depth: int = 2, pin_device: torch.device | None = None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be >= 1")
        self.source, self.depth, self.pin_device = source, depth, pin_device
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot: Any = None  # the source's position after the last batch taken (None: nothing taken)
        self._error: BaseException | None = None

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("PrefetchedBatches.load_state_dict must be called before the first next()")
        self.source.load_state_dict(state)

    def state_dict(self) -> dict:
        """The source's state after the batches taken so far (collective where the source's is)."""
        return self.source.state_dict(self._snapshot)

    def next(self):
        if self._error is not None:
            raise self._error
        if self._thread is None:  # started late: a loaded state comes first
            self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
            self._thread.start()
        while True:
            try:
                kind, item, snapshot = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch prefetch thread ended without a batch or an error") from None
        if kind == "error":
            self._error = item
            raise item
        self._snapshot = snapshot
        return item

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue or inside the source) and wait for it."""
        self._stop.set()
        if self._thread is None:
            return
        while self._thread.is_alive():
            try:  # room for a put that is waiting, so the thread sees the stop
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=_POLL_S)
        self._thread = None

    def _produce(self) -> None:
        try:
            if self.pin_device is not None and self.pin_device.type == "cuda":
                torch.cuda.set_device(self.pin_device)  # pinned buffers for this device's context, not device 0's
            while not self._stop.is_set():
                batch = self.source.next()
                snapshot = self.source.snapshot()
                if self.pin_device is not None:
                    batch = batch.pin_memory()
                if not self._put(("batch", batch, snapshot)):
                    return
        except BaseException as exc:  # handed to the step, which raises it (the thread itself ends quietly)
            self._put(("error", exc, None))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False
