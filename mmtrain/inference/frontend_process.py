"""``python -m mmtrain.serve``'s HTTP frontend in a process of its own beside the engine's, as vLLM's API server
beside its engine core: the app's Python (request parsing, JSON, HTTP framing, socket writes) and the engine
thread's no longer take turns on one interpreter lock, so the engine steps at its own speed and a stream that
falls behind gets its text in fewer, larger events (``engine_client``).

The engine's process (tensor-parallel rank 0; its peers follow it as before) binds the port, loads the model and
starts the frontend with the listening socket and one end of a socket pair (``serve_with_frontend``). The
frontend builds its tokenizer and chat template by calling ``parts`` there (a picklable callable), serves the
FastAPI app (``openai_app``) through a ``ProcessEngineClient`` and says when it is ready. The engine's process
turns each submission into a ``Sequence`` for its ``EngineThread`` (detokenized there, as in one process) and
sends each step's updates as one message.

Failures keep server_engine's rules: a request that fails alone ends alone (its last update says "error"). A
fatal (tensor-parallel) failure ends every request with an error, then tells the frontend, which refuses new
requests (503) and stops. The frontend's process exiting, stopped or crashed, ends the serving; the engine's
process going away closes the socket pair, and the frontend stops. Signals: the frontend leaves the terminal's process
group, so SIGINT / SIGTERM reach the engine's process alone, which passes them on: the frontend stops as uvicorn
does (requests in flight finish; a second SIGINT stops at once), then the engine.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable

from mmtrain.inference.engine import ContextLengthError, Sequence
from mmtrain.inference.engine_client import CANCEL, STOPPED, SUBMIT, UPDATES, MessageChannel, ProcessEngineClient
from mmtrain.inference.sampling import SamplingError
from mmtrain.inference.server_engine import EngineStopped, EngineThread, freeze_heap
from mmtrain.utils.log import get_logger, setup_logging

READY = "ready"  # the frontend's first message: it serves
_START_TIMEOUT_S = 600.0  # the frontend imports FastAPI and torch and loads the tokenizer: seconds, not minutes


class FrontendError(RuntimeError):
    """The frontend's process did not start, or exited on its own; the message says how."""


def serve_with_frontend(engine: EngineThread, decode: Callable[[list[int]], str], parts: Callable, model_name: str,
                        max_request_bytes: int, listener: socket.socket,
                        on_ready: Callable[[int], None] | None = None) -> None:
    """Serve ``engine`` over HTTP on ``listener`` from a frontend process until it stops (after SIGINT / SIGTERM to
    this process, which are passed on, or a fatal engine failure); ``decode``: ids to text, for the engine thread;
    ``parts()`` runs in the frontend and returns (tokenizer, ChatPrompts or None); ``on_ready(frontend_pid)``:
    called once it serves. Sets ``engine.on_fatal``; installs SIGINT / SIGTERM handlers meanwhile. Raises
    ``FrontendError`` when the frontend does not start or exits on its own (not after a signal or the engine's
    failure)."""
    model = engine.engine
    frontend = _Frontend(parts, model_name, max_request_bytes, model.max_len, model.model.cfg.vocab_size, listener)
    engine.on_fatal = frontend.stop_serving
    if engine.failure is not None:  # it failed before it could tell
        frontend.stop_serving(engine.failure)
    signalled: list[int] = []

    def pass_on(signum, frame) -> None:
        signalled.append(signum)
        frontend.signal(signum)
    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            frontend.wait_ready()
        except FrontendError:
            if signalled:  # stopped while it started
                return
            raise
        freeze_heap()
        if on_ready is not None:
            on_ready(frontend.pid)
        code = frontend.serve(engine, decode)
    finally:
        frontend.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and not signalled and engine.failure is None:
        raise FrontendError(f"the HTTP frontend's process (pid {frontend.pid}) exited with code {code}; its "
                            "error is in the log above")


class _Frontend:
    """The frontend's process, seen from the engine's: the engine's end of their socket pair."""

    def __init__(self, parts: Callable, model_name: str, max_request_bytes: int, max_len: int, vocab_size: int,
                 listener: socket.socket) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the engine's threads or CUDA
        mine, theirs = socket.socketpair()
        self.channel = MessageChannel(mine)
        self.process = ctx.Process(target=_frontend_main, name="mmtrain-http", daemon=True, args=(
            parts, model_name, max_request_bytes, max_len, vocab_size, listener, theirs))
        self.process.start()
        theirs.close()  # the frontend holds it now: its exit closes the pair
        self._send_lock = threading.Lock()  # updates go out from the engine thread, refusals from serve()
        self._gone = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self) -> None:
        messages: list = []
        while not messages:
            if not select.select([self.channel], [], [], _START_TIMEOUT_S)[0]:
                raise FrontendError(f"the HTTP frontend's process did not start in {_START_TIMEOUT_S:.0f} s")
            try:
                messages = self.channel.receive()
            except (EOFError, OSError):
                self.process.join()
                raise FrontendError(f"the HTTP frontend's process exited while starting (exit code "
                                    f"{self.process.exitcode}); its error is in the log above") from None
        if messages != [(READY,)]:
            raise FrontendError(f"the HTTP frontend's process said {messages!r} instead of {READY!r}")

    def signal(self, signum: int) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signum)

    def serve(self, engine: EngineThread, decode: Callable[[list[int]], str]) -> int:
        """The engine's side, until the frontend's process exits: its submissions become sequences of ``engine``,
        its cancellations mark them. Returns the frontend's exit code."""
        running: dict[int, Sequence] = {}
        while True:
            try:
                messages = self.channel.receive()  # all that has arrived: one wait for the interpreter lock
            except (EOFError, OSError):
                break
            for message in messages:
                self._handle(message, engine, decode, running)
        self.process.join()
        return self.process.exitcode

    def _handle(self, message: tuple, engine: EngineThread, decode, running: dict[int, Sequence]) -> None:
        if message[0] == SUBMIT:
            _, rid, prompt_ids, params = message
            seq = Sequence(prompt_ids, params, decode=decode, on_token=self._on_token(engine, rid, running))
            try:
                engine.check(seq)  # the frontend checked as the engine does: a refusal here is a race
                running[rid] = seq
                engine.submit(seq)
            except (SamplingError, ContextLengthError, EngineStopped) as exc:
                running.pop(rid, None)
                get_logger("serve").error(f"a request was refused by the engine ({exc})")
                self._send((UPDATES, [(rid, "", True, "error", 0, len(prompt_ids))]))
        elif message[0] == CANCEL:
            seq = running.pop(message[1], None)
            if seq is not None:
                seq.cancelled = True
        else:
            get_logger("serve").error(f"the HTTP frontend sent an unknown message {message[0]!r}; ignored")

    def _on_token(self, engine: EngineThread, rid: int, running: dict[int, Sequence]):
        deliver, sink = engine.deliver, self._send_updates

        def on_token(s: Sequence, text: str, done: bool) -> None:  # the engine thread's, per token
            if done:
                running.pop(rid, None)
            deliver(sink, (rid, text, done, s.finish_reason, len(s.token_ids), s.prompt_text_end))
        return on_token

    def _send_updates(self, items: list) -> None:
        self._send((UPDATES, items))

    def stop_serving(self, message: str) -> None:
        """The engine cannot go on (``EngineThread.on_fatal``): the frontend refuses new requests and stops."""
        self._send((STOPPED, message))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self._gone:
                return
            try:
                self.channel.send(message)
            except OSError:  # the frontend's process has exited: serve() returns as the pair closes
                self._gone = True

    def close(self) -> None:
        self.signal(signal.SIGTERM)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.channel.close()


def _frontend_main(parts: Callable, model_name: str, max_request_bytes: int, max_len: int, vocab_size: int,
                   listener: socket.socket, engine_end: socket.socket) -> None:
    """The frontend's process: the app over a ``ProcessEngineClient`` on ``listener`` until SIGINT / SIGTERM (passed
    on by the engine's process) or the engine stops."""
    os.setsid()  # out of the terminal's process group: a Ctrl-C reaches it once, through the engine's process
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopped while it starts: exit quietly
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    import uvicorn

    from mmtrain.inference.openai_app import build_app

    setup_logging(0)
    tokenizer, chat = parts()
    server: uvicorn.Server | None = None

    def stop(message: str) -> None:
        if server is not None:
            server.should_exit = True
    channel = MessageChannel(engine_end)
    client = ProcessEngineClient(max_len, vocab_size, channel, on_stop=stop)
    server = uvicorn.Server(uvicorn.Config(build_app(client, tokenizer, model_name, chat, max_request_bytes),
                                           log_level="info"))
    # uvicorn raises the signal that stopped it again for the handler it found: this one lets the process exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    asyncio.run(_serve(server, client, listener))


async def _serve(server, client: ProcessEngineClient, listener: socket.socket) -> None:
    client.attach(asyncio.get_running_loop())
    freeze_heap()
    client.channel.send((READY,))
    await server.serve(sockets=[listener])
