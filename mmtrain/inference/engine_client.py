"""The HTTP side's view of the engine, on an asyncio event loop: ``EngineClient.start`` checks a request as the
engine would and submits it; each engine step's updates arrive in one call (``receive``) whatever their number,
and each request's text waits in its ``Completion`` until its handler takes it. A stream that falls behind takes
every piece waiting at once, so a busy server sends fewer, larger events instead of slowing its engine.

Two ways to reach the engine:

- ``ThreadEngineClient``: an ``EngineThread`` in this process (tests, an app embedded in another program). The
  HTTP side's Python and the engine's then take turns on one interpreter lock.
- ``ProcessEngineClient``: the engine in another process (``python -m mmtrain.serve``, ``frontend_process``), over a
  socket pair (``MessageChannel``): submissions and cancellations one way, one message per engine step the other.
  The engine's process never waits for the HTTP side's JSON, HTTP framing and socket writes.

An update is ``(rid, text, done, finish_reason, completion_tokens, prompt_text_end)``: the request's new text,
whether it has ended and, as of this step, why, its completion's tokens and how many prompt tokens have their text
before it (``Sequence.prompt_text_end``, what an echo shows).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import pickle
import socket
import struct
from collections.abc import Callable

from mmtrain.inference.engine import Sequence, check_request
from mmtrain.inference.sampling import SamplingParams
from mmtrain.inference.server_engine import EngineStopped, EngineThread

SUBMIT, CANCEL = "submit", "cancel"  # the frontend's messages to the engine's process
UPDATES, STOPPED = "updates", "stopped"  # the engine's process's messages to the frontend


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles the channel's messages: tuples, lists, strings, numbers, None and ``SamplingParams`` (its fields
    are plain values), nothing else. The other end is this program's own process, but a message never gets to
    name a class to build (the project's rule: exact allow-lists wherever something is unpickled)."""

    ALLOWED = {("mmtrain.inference.sampling", "SamplingParams"): SamplingParams}

    def find_class(self, module: str, name: str):
        found = self.ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"the engine channel does not carry {module}.{name}")
        return found


class MessageChannel:
    """Pickled messages over one end of a socket pair (between this program's own two processes), each behind its
    length. ``receive`` takes everything that has arrived in one system call: a reader in a thread beside a busy
    one waits for the interpreter lock once per wake-up, not twice per message."""

    _LENGTH = struct.Struct("<Q")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(self._LENGTH.pack(len(data)) + data)

    def receive(self) -> list:
        """The complete messages among the bytes that have arrived (waits for some; possibly none is complete
        yet). Raises EOFError once the other end has closed."""
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the other process closed its end")
        pending = self._pending
        pending += chunk
        messages, at, size = [], 0, self._LENGTH.size
        while len(pending) - at >= size:
            (n,) = self._LENGTH.unpack_from(pending, at)
            if len(pending) - at - size < n:
                break
            messages.append(_AllowListUnpickler(io.BytesIO(memoryview(pending)[at + size:at + size + n])).load())
            at += size + n
        del pending[:at]
        return messages

    def close(self) -> None:
        self.sock.close()


class Completion:
    """One request as the HTTP side sees it. ``text``: all its text so far (the whole once finished);
    ``finish_reason`` (None while running), ``completion_tokens``, ``prompt_text_end``."""

    __slots__ = ("rid", "prompt_ids", "finish_reason", "completion_tokens", "prompt_text_end", "_pieces",
                 "_taken", "_waiter", "_handle")

    def __init__(self, rid: int, prompt_ids: list[int]) -> None:
        self.rid, self.prompt_ids = rid, prompt_ids
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.prompt_text_end = len(prompt_ids)
        self._pieces: list[str] = []  # the text as it arrived
        self._taken = 0  # pieces next_text has handed out
        self._waiter: asyncio.Future | None = None
        self._handle: object = None  # the transport's own (the engine's Sequence, in one process)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    async def next_text(self) -> tuple[str, bool]:
        """The text that arrived since the last call (every piece, as one) and whether the request has ended;
        waits while there is neither."""
        while self._taken == len(self._pieces) and self.finish_reason is None:
            await self._wait()
        new = self._pieces[self._taken:]
        self._taken = len(self._pieces)
        return (new[0] if len(new) == 1 else "".join(new)), self.finish_reason is not None

    async def wait(self) -> None:
        """Until the request has ended."""
        while self.finish_reason is None:
            await self._wait()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _apply(self, text: str, done: bool, finish_reason: str | None, completion_tokens: int,
               prompt_text_end: int) -> None:
        if text:
            self._pieces.append(text)
        self.completion_tokens, self.prompt_text_end = completion_tokens, prompt_text_end
        if done:
            self.finish_reason = finish_reason or "error"
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EngineClient:
    """What the app needs of an engine: ``max_len`` (positions per slot), ``vocab_size``, ``failure`` (why the
    engine stopped serving; None while it serves), ``start`` / ``cancel`` and ``receive`` (the transport calls it
    on the event loop with a step's updates)."""

    def __init__(self, max_len: int, vocab_size: int) -> None:
        self.max_len, self.vocab_size = max_len, vocab_size
        self._open: dict[int, Completion] = {}
        self._ids = itertools.count()

    @property
    def failure(self) -> str | None:
        raise NotImplementedError

    def start(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Check the request (``SamplingError`` / ``ContextLengthError``, as the engine would refuse it) and submit
        it; ``EngineStopped`` once the engine no longer serves. Call on the event loop that will read it."""
        check_request(len(prompt_ids), params, self.max_len)
        if self.failure is not None:
            raise EngineStopped(self.failure)
        completion = Completion(next(self._ids), prompt_ids)
        self._submit(completion, params)
        self._open[completion.rid] = completion
        return completion

    def cancel(self, completion: Completion) -> None:
        """The client went away: the engine frees its slot at its next step (nothing more arrives for it)."""
        if self._open.pop(completion.rid, None) is not None:
            self._cancel(completion)

    def receive(self, updates: list[tuple]) -> None:
        """One step's updates (on the event loop)."""
        open_ = self._open
        for rid, text, done, finish_reason, completion_tokens, prompt_text_end in updates:
            completion = open_.pop(rid, None) if done else open_.get(rid)
            if completion is not None:  # else cancelled meanwhile
                completion._apply(text, done, finish_reason, completion_tokens, prompt_text_end)

    def _end_all(self) -> None:
        """The engine stopped: every open request ends with an error."""
        open_, self._open = self._open, {}
        for completion in open_.values():
            completion._apply("", True, "error", completion.completion_tokens, completion.prompt_text_end)

    def _submit(self, completion: Completion, params: SamplingParams) -> None:
        raise NotImplementedError

    def _cancel(self, completion: Completion) -> None:
        raise NotImplementedError


class ThreadEngineClient(EngineClient):
    """``engine`` runs in this process; ``decode`` turns ids into text (the engine thread detokenizes)."""

    def __init__(self, engine: EngineThread, decode: Callable[[list[int]], str]) -> None:
        super().__init__(engine.engine.max_len, engine.engine.model.cfg.vocab_size)
        self.engine, self.decode = engine, decode
        self._sinks: dict[asyncio.AbstractEventLoop, Callable[[list], None]] = {}

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    def _sink(self, loop: asyncio.AbstractEventLoop) -> Callable[[list], None]:
        """The engine thread's sink for ``loop``: a step's updates for it, in one wake-up of the loop."""
        sink = self._sinks.get(loop)
        if sink is None:
            for old in [old for old in self._sinks if old.is_closed()]:
                del self._sinks[old]

            def sink(items: list) -> None:
                try:
                    loop.call_soon_threadsafe(self.receive, items)
                except RuntimeError:  # that loop is closed: its clients are gone
                    pass
            self._sinks[loop] = sink
        return sink

    def _submit(self, completion: Completion, params: SamplingParams) -> None:
        sink, deliver, rid = self._sink(asyncio.get_running_loop()), self.engine.deliver, completion.rid
        seq = Sequence(list(completion.prompt_ids), params, decode=self.decode,
                       on_token=lambda s, text, done: deliver(sink, (rid, text, done, s.finish_reason,
                                                                     len(s.token_ids), s.prompt_text_end)))
        self.engine.submit(seq)
        completion._handle = seq

    def _cancel(self, completion: Completion) -> None:
        completion._handle.cancelled = True


class ProcessEngineClient(EngineClient):
    """The engine in another process, over ``channel`` (``frontend_process``'s socket pair: submissions and
    cancellations out, a step's updates in). ``on_stop(message)``: called once when the engine stops serving or
    its process goes away (the frontend then shuts down). ``attach`` the event loop before serving."""

    def __init__(self, max_len: int, vocab_size: int, channel: MessageChannel,
                 on_stop: Callable[[str], None] | None = None) -> None:
        super().__init__(max_len, vocab_size)
        self.channel, self.on_stop = channel, on_stop
        self._failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def failure(self) -> str | None:
        return self._failure

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on ``loop`` (whenever its pipe has some: no thread)."""
        self._loop = loop
        loop.add_reader(self.channel.fileno(), self._read)

    def _read(self) -> None:
        try:
            messages = self.channel.receive()
        except (EOFError, OSError):
            self._stopped("the engine's process went away")
            return
        for kind, payload in messages:
            if kind == UPDATES:
                self.receive(payload)
            else:
                self._stopped(payload)
                return

    def _stopped(self, message: str) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.channel.fileno())
        if self._failure is None:
            self._failure = message
            self._end_all()
            if self.on_stop is not None:
                self.on_stop(message)

    def _submit(self, completion: Completion, params: SamplingParams) -> None:
        try:
            self.channel.send((SUBMIT, completion.rid, completion.prompt_ids, params))
        except OSError:
            self._stopped("the engine's process went away")
            raise EngineStopped(self._failure) from None

    def _cancel(self, completion: Completion) -> None:
        try:
            self.channel.send((CANCEL, completion.rid))
        except OSError:
            pass  # the engine is gone: nothing to free
