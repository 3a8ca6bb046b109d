"""The server's streams (issue #32, the server row), driven through the real FastAPI app over ASGI (no sockets):
a stream that falls behind gets its pieces coalesced into fewer events whose text is still exact; every event is
OpenAI's chunk, encoded as the whole object would be; a client that stops reading holds up neither the engine nor
the other streams; one request's error or disconnect ends it alone."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from mmtrain.core.tokenizer import load_tokenizer  # noqa: E402
from mmtrain.inference.engine import DecodeEngine  # noqa: E402
from mmtrain.inference.engine_client import EngineClient, ThreadEngineClient  # noqa: E402
from mmtrain.inference.openai_app import _Events, _sse, build_app  # noqa: E402
from mmtrain.inference.server_engine import EngineThread  # noqa: E402
from mmtrain.serve import chat_prompts  # noqa: E402
from tests.inference_helpers import tiny_config, tiny_model, tiny_tokenizer  # noqa: E402

PIECES = ["Hel", "lo", " wö", "rld", ",", " \"quoted\" \\ back", "\u2028line\tsep\x01", "🦙", " end"]


class ManualEngine(EngineClient):
    """An engine whose updates the test sends (``receive``), step by step."""

    def __init__(self) -> None:
        super().__init__(max_len=64, vocab_size=512)
        self.cancelled: list[int] = []

    failure = None

    def _submit(self, completion, params) -> None:
        pass

    def _cancel(self, completion) -> None:
        self.cancelled.append(completion.rid)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class Call:
    """One HTTP request to the app over ASGI. ``hold`` (an asyncio.Event) stalls its response body after the
    first part until set: a client that stops reading."""

    def __init__(self, app, path: str, body: dict, hold: asyncio.Event | None = None) -> None:
        self.messages: list[dict] = []
        self.hold = hold
        self.gone = asyncio.Event()
        raw = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": raw, "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}
        self.task = asyncio.ensure_future(app(scope, receive, self._send))

    async def _send(self, message: dict) -> None:
        self.messages.append(message)
        if self.hold is not None and message["type"] == "http.response.body" and len(self.messages) == 2:
            await self.hold.wait()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    def events(self) -> list[dict]:
        lines = [line for line in self.body.decode().split("\n\n") if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    async def done(self) -> None:
        await asyncio.wait_for(self.task, 60)


async def _until(condition, what: str) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def _texts(events: list[dict], chat: bool) -> list[str]:
    if chat:
        return [e["choices"][0]["delta"].get("content", "") for e in events]
    return [e["choices"][0]["text"] for e in events]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_behind_the_engine_gets_fewer_events_with_the_exact_text(tokenizer_path, chat):
    tok = load_tokenizer(tokenizer_path)
    engine = ManualEngine()
    app = build_app(engine, tok, "tiny", chat_prompts(tok, tokenizer_path, "tokenizer"))

    async def run():
        path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}) if chat else \
            ("/v1/completions", {"prompt": "Hello"})
        call = Call(app, path, {**body, "max_tokens": 32, "stream": True})
        await _until(lambda: engine._open, "the request reached the engine")
        (rid,) = engine._open
        n = 0
        # steps 1-2 arrive while the stream waits; 3-6 in a row before it runs again; then one at a time
        for group in ([0], [1], [2, 3, 4, 5], [6], [7], [8]):
            for i in group:
                n += 1
                last = i == len(PIECES) - 1
                engine.receive([(rid, PIECES[i], last, "length" if last else None, n, 2)])
            await asyncio.sleep(0.01)
        await call.done()
        return call.events()
    events = asyncio.run(run())
    assert "".join(_texts(events, chat)) == "".join(PIECES)
    assert len(events) < len(PIECES)  # the four pieces that waited together went out as one event
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(e["object"] == kind and e["id"] == events[0]["id"] for e in events)
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("text", PIECES + ["", "plain", "\x00", "\ud7ff\ue000", "a\nb\r\n"])
def test_an_event_from_the_encoded_template_equals_the_whole_objects_encoding(text):
    def chunk(t, finish, first):  # the shape of openai_app's completion chunks
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "text": t, "finish_reason": finish, "logprobs": None}]}
    events = _Events(chunk)
    assert events.parts is not None
    for finish, first in ((None, False), (None, True), ("stop", False)):
        assert events.event(text, finish, first) == _sse(chunk(text, finish, first))


def test_a_client_that_stops_reading_holds_up_neither_the_engine_nor_the_others(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    thread = EngineThread(DecodeEngine(tiny_model(tiny_config(vocab_size=tok.vocab_size)), 4, 96))
    try:
        client = ThreadEngineClient(thread, tok.decode)
        app = build_app(client, tok, "tiny")
        body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 40, "temperature": 0}

        async def run():
            alone = Call(app, "/v1/completions", body)
            await alone.done()
            hold = asyncio.Event()
            slow = Call(app, "/v1/completions", {**body, "stream": True}, hold=hold)
            await _until(lambda: len(slow.messages) >= 2, "the slow stream's first event")
            (completion,) = client._open.values()
            steps = thread.steps
            others = [Call(app, "/v1/completions", {**body, "prompt": p, "stream": s})
                      for p in ("Hello world", "Numbers 123") for s in (False, True)]
            for other in others:
                await other.done()  # while the slow client reads nothing
            assert not slow.task.done() and len(slow.messages) == 2
            assert thread.steps > steps
            await _until(lambda: completion.finished, "the engine finishes the slow client's request meanwhile")
            assert not slow.task.done() and len(slow.messages) == 2
            hold.set()
            await slow.done()
            return alone, slow, others
        alone, slow, others = asyncio.run(run())
        whole = json.loads(alone.body)["choices"][0]["text"]
        assert "".join(_texts(slow.events(), False)) == whole
        for other in others:
            assert other.messages[0]["status"] == 200
    finally:
        thread.close()


def test_one_requests_error_or_disconnect_ends_it_alone(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    engine = ManualEngine()
    app = build_app(engine, tok, "tiny")

    async def run():
        calls = [Call(app, "/v1/completions", {"prompt": f"Hello {i}", "max_tokens": 8, "stream": i != 1})
                 for i in range(4)]
        await _until(lambda: len(engine._open) == 4, "four requests in the engine")
        rid_of = {tuple(c.prompt_ids): rid for rid, c in engine._open.items()}
        ok, failing, dropped, failing_stream = (rid_of[tuple(tok.encode(f"Hello {i}"))] for i in range(4))
        engine.receive([(r, "a", False, None, 1, 2) for r in (ok, failing, dropped, failing_stream)])
        await asyncio.sleep(0.01)
        calls[2].gone.set()  # its client disconnects
        await _until(lambda: dropped in engine.cancelled, "the dropped stream is cancelled")
        engine.receive([(ok, "b", False, None, 2, 2), (failing, "", True, "error", 1, 2),
                        (dropped, "x", False, None, 2, 2), (failing_stream, "", True, "error", 1, 2)])
        engine.receive([(ok, "c", True, "length", 3, 2)])
        for call in calls:
            await call.done()
        return calls
    ok, failing, dropped, failing_stream = asyncio.run(run())
    assert "".join(_texts(ok.events(), False)) == "abc" and ok.events()[-1]["choices"][0]["finish_reason"] == "length"
    assert failing.messages[0]["status"] == 500 and "failed" in json.loads(failing.body)["error"]["message"]
    assert failing_stream.events()[-1]["choices"][0]["finish_reason"] == "error"
    sent = [json.loads(e.removeprefix("data: ")) for e in dropped.body.decode().split("\n\n")
            if e.startswith("data: {")]
    assert _texts(sent, False) == ["a"]  # nothing after it went away
