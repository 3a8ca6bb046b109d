"""The serving side of the decode engine: one thread owns the model and its cache and loops — take new requests,
one engine step (their prefill joins the running batch), hand tokens back — so concurrent requests are decoded
together (continuous batching) while the HTTP event loop never runs model code.

Requests arrive through a thread-safe queue; tokens go back through each request's ``on_token`` callback, which
the HTTP side points at ``deliver``: the step's tokens reach their asyncio queues in one ``call_soon_threadsafe``
per event loop and step. A step that fails ends the
requests it held with an error and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import torch

from mmtrain.inference.engine import DecodeEngine, Sequence
from mmtrain.inference.sampling import SamplingParams
from mmtrain.utils.log import get_logger


class EngineThread:
    """Runs ``engine`` in a daemon thread. ``submit(seq)`` queues a checked sequence (``DecodeEngine.submit``'s
    checks are the caller's: ``check(seq)`` raises before anything is queued). A failed step calls
    ``seq.on_token(seq, "", True)`` with ``seq.finish_reason = "error"`` for every sequence it held."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[Sequence | None] = queue.Queue()
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = []
        self._thread = threading.Thread(target=self._loop, name="mmtrain-engine", daemon=True)
        self._stopping = False
        self.steps = 0
        self._thread.start()

    def check(self, seq: Sequence) -> None:
        """Raise ``SamplingError`` / ``ContextLengthError`` for a sequence the engine would refuse."""
        self.engine.check(seq)

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(seq)

    def deliver(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, item: object) -> None:
        """From the engine thread (an ``on_token`` callback): put ``item`` on ``out``, an asyncio queue of ``loop``,
        after the current step; one wake-up of each event loop per step, whatever the number of tokens."""
        self._outbox.append((loop, out, item))

    def _flush(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, out, item in self._outbox:
            by_loop.setdefault(loop, []).append((out, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its clients are gone
                pass

    def warmup(self, steps: int = 4, timeout_s: float = 1800.0) -> None:
        """Decode a throwaway sequence in the engine thread and wait for it: a compiled decode step compiles
        and captures its CUDA graphs there (the thread that will replay them) before the first request."""
        done = threading.Event()
        seq = Sequence([0], SamplingParams(max_new_tokens=steps),
                       on_token=lambda s, text, finished: finished and done.set())
        self.submit(seq)
        if not done.wait(timeout_s):
            raise RuntimeError(f"the engine's warm-up did not finish in {timeout_s:.0f} s")
        if seq.finish_reason == "error":
            raise RuntimeError("the engine's warm-up step failed (the error is in the log above)")

    def close(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _take(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            self.engine.submit(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        log = get_logger("serve")
        with torch.no_grad():
            while not self._stopping:
                self._take(block=not self.engine.busy)
                if not self.engine.busy:
                    continue
                try:
                    self.engine.step()
                    self.steps += 1
                except Exception as exc:  # noqa: BLE001 - the server must keep serving; the requests get the error
                    log.error(f"decode step failed ({type(exc).__name__}: {exc}); its requests end with an error")
                    for s in self.engine.abort_all():
                        s.finish_reason = "error"
                        if s.on_token is not None:
                            s.on_token(s, "", True)
                self._flush()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for out, item in items:
        out.put_nowait(item)
