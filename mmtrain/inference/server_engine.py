"""The serving side of the decode engine: one thread owns the model and its cache and loops — take new requests,
one engine step (their prefill joins the running batch), hand tokens back — so concurrent requests are decoded
together (continuous batching) while the HTTP side never runs model code.

Requests arrive through a thread-safe queue; tokens go back through each request's ``on_token`` callback, which
the HTTP side points at ``deliver``: after each step every sink (an event loop in this process, or the pipe to
the HTTP frontend's process: ``engine_client``) receives that step's updates in one call, whatever their number.
A request whose own work fails (its prefill, its
draw, its text: ``DecodeEngine``) ends alone with an error; a decode step that fails ends the requests it held with
an error; either way the thread keeps serving — in one process. Under tensor parallelism (an engine
with peers, ``step_broadcast``) the other ranks may be inside that step's collectives, so a failed step, or a peer
that stops answering, is fatal: every request ends with an error, new ones are refused (``EngineStopped``), the
``on_fatal`` callback stops the HTTP server. While idle the thread sends the peers a heartbeat; when it stops it
tells them to return.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable

import torch

from mmtrain.inference.engine import DecodeEngine, Sequence
from mmtrain.inference.sampling import SamplingParams
from mmtrain.utils.log import get_logger

_IDLE_WAIT_S = 0.5  # the longest wait for new work: also the peers' heartbeat period (they time out far later)


class EngineStopped(RuntimeError):
    """The engine thread has stopped (a fatal tensor-parallel failure, or shutdown); the message says why."""


class EngineThread:
    """Runs ``engine`` in a daemon thread. ``submit(seq)`` queues a checked sequence (``DecodeEngine.submit``'s
    checks are the caller's: ``check(seq)`` raises before anything is queued). A failed step calls
    ``seq.on_token(seq, "", True)`` with ``seq.finish_reason = "error"`` for every sequence it held.
    ``on_fatal(message)``: called from the engine thread once, when a tensor-parallel engine cannot go on."""

    def __init__(self, engine: DecodeEngine, on_fatal: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.failure: str | None = None  # why the thread stopped serving, after a fatal failure
        self._lock = threading.Lock()  # a submit sees the failure, or its sequence is failed with the others
        self._inbox: queue.Queue[Sequence | None] = queue.Queue()
        self._outbox: dict[Callable[[list], None], list] = {}  # sink -> this step's items for it
        self._thread = threading.Thread(target=self._loop, name="mmtrain-engine", daemon=True)
        self._stopping = False
        self.steps = 0
        self._thread.start()

    def check(self, seq: Sequence) -> None:
        """Raise ``SamplingError`` / ``ContextLengthError`` for a sequence the engine would refuse."""
        self.engine.check(seq)

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; raises ``EngineStopped`` once the thread no longer serves."""
        with self._lock:
            if self.failure is not None or self._stopping:
                raise EngineStopped(self.failure or "the server is shutting down")
            self._inbox.put(seq)

    def deliver(self, sink: Callable[[list], None], item: object) -> None:
        """From the engine thread (an ``on_token`` callback): hand ``item`` to ``sink`` after the current step. Each
        sink is called once per step with the step's items for it, in order; a sink handles its own failures (a
        closed event loop, a frontend gone) and never raises."""
        items = self._outbox.get(sink)
        if items is None:
            self._outbox[sink] = [item]
        else:
            items.append(item)

    def _flush(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for sink, items in outbox.items():
            sink(items)

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
            item = self._inbox.get(block=block, timeout=_IDLE_WAIT_S if block else None)
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
                try:
                    if not self.engine.busy:
                        self.engine.heartbeat()
                        continue
                    ended = self.engine.step()
                    self.steps += 1
                    if ended:
                        _log_ends(log, ended)
                except Exception as exc:  # noqa: BLE001 - the server must keep serving; the requests get the error
                    what = f"{type(exc).__name__}: {exc}"
                    if self.engine.tensor_parallel:
                        self._fail(f"the tensor-parallel engine stopped ({what}); the server shuts down")
                        return
                    log.error(f"decode step failed ({what}); its requests end with an error")
                    self._end_with_error(self.engine.abort_all())
                self._flush()
            try:
                self.engine.stop_peers()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway; the peers time out
                log.warning(f"could not tell the other tensor-parallel ranks to stop: {exc}")

    def _end_with_error(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.finish_reason = "error"
            if s.on_token is not None:
                s.on_token(s, "", True)

    def _fail(self, message: str) -> None:
        get_logger("serve").error(message)
        with self._lock:
            self.failure = message
            pending = []
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item)
        self._end_with_error(self.engine.abort_all() + pending)
        self._flush()
        if self.on_fatal is not None:
            self.on_fatal(message)


def freeze_heap() -> None:
    """Once a serving process has started (model, tokenizer, app, imports): collect, then move every object left to
    the permanent generation. A full collection walks every object a process holds; with torch, FastAPI and the
    tokenizer loaded one took 111 ms in the frontend on the H200's host (bench/serve_trace.py), and no request
    reached the engine meanwhile: that round's 32 streams waited 167 ms for their first token against ~50. What
    start-up made lives as long as the process, so collections need only walk what serving makes."""
    gc.collect()
    gc.freeze()


def _log_ends(log, ended: list[Sequence]) -> None:
    """One line for each request that failed alone or whose client went away (the others finished as asked)."""
    for s in ended:
        if s.finish_reason == "error":
            log.error(f"a request ended with an error ({s.error}); the other requests go on")
        elif s.finish_reason == "cancelled":
            log.info(f"a client went away after {len(s.token_ids)} of {s.params.max_new_tokens} new tokens; "
                     "its slot is free")
