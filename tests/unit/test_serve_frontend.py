"""``python -m mmtrain.serve`` serves its HTTP app from a process of its own beside the engine's (issue #32: the
app's Python no longer shares the engine's interpreter lock): concurrent answers, streamed and not, equal the
one-at-a-time answers; SIGTERM to the server's process stops both processes with exit code 0. Through the pipe
between them: a request whose own work fails ends alone, and a fatal engine failure ends every request with an
error and stops the server (exit code 1)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.frontend_server import FATAL, POISON  # noqa: E402
from tests.inference_helpers import tiny_checkpoint, tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown", "Hello world", "Numbers 123", "Café", "def f(x):", "lazy dog", "hello server", "x"]


def _start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, re.Match]:
    with open(log, "wb") as out:  # one intra-op thread: two spin against the other processes of a small machine
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (found := re.search(r"serving 'tiny' on (http://\S+) \((?:pid (\d+), .*HTTP frontend is pid|frontend "
                                  r"pid) (\d+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    return proc, found


def _ask(client: httpx.AsyncClient, url: str, body: dict) -> "asyncio.Future":
    async def one():
        if not body.get("stream"):
            r = await client.post(f"{url}/v1/completions", json=body)
            return r.status_code, r.json()
        events = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        return r.status_code, events
    return one()


def _text(answer) -> str:
    status, got = answer
    assert status == 200, got
    if isinstance(got, dict):
        return got["choices"][0]["text"]
    assert got[-1]["choices"][0]["finish_reason"] in ("length", "stop"), got[-1]
    return "".join(e["choices"][0]["text"] for e in got)


def _together(url: str, bodies: list[dict]) -> list:
    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_ask(client, url, b) for b in bodies))
    return asyncio.run(run())


def test_the_app_runs_in_its_own_process_and_sigterm_stops_both(tmp_path):
    ckpt, tok = tiny_checkpoint(tmp_path / "ckpt"), tiny_tokenizer(tmp_path / "tok")
    log = tmp_path / "serve.log"
    proc, found = _start([sys.executable, "-m", "mmtrain.serve", "--ckpt", str(ckpt), "--tokenizer", str(tok),
                          "--port", "0", "--slots", "8", "--context", "96", "--device", "cpu", "--model-name",
                          "tiny"], log)
    try:
        url, pid, frontend = found.group(1), int(found.group(2)), int(found.group(3))
        assert pid == proc.pid and frontend != pid
        assert f"PPid:\t{pid}\n" in Path(f"/proc/{frontend}/status").read_text()
        bodies = [dict(model="tiny", prompt=PROMPTS[i % 8] + " " * (i // 8), max_tokens=4 + (i * 7) % 29,
                       temperature=0, stream=bool(i % 2)) for i in range(16)]
        single = [_text(a) for b in bodies for a in _together(url, [b])]
        assert [_text(a) for a in _together(url, bodies)] == single
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()
    assert not Path(f"/proc/{frontend}").exists()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_a_request_that_fails_ends_alone_and_a_fatal_step_stops_the_server(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    log = tmp_path / "serve.log"
    proc, found = _start([sys.executable, "-m", "tests.frontend_server", str(tok)], log)
    try:
        url = found.group(1)
        bodies = [dict(prompt=PROMPTS[i % 8], max_tokens=12 + i, temperature=0, stream=bool(i % 2)) for i in range(8)]
        single = [_text(a) for b in bodies for a in _together(url, [b])]
        poisoned = [dict(prompt=POISON, max_tokens=8, stream=s) for s in (False, True)]
        answers = _together(url, bodies[:4] + poisoned + bodies[4:])
        assert [_text(a) for a in answers[:4] + answers[6:]] == single
        (status, body), (stream_status, events) = answers[4:6]
        assert status == 500 and "failed" in body["error"]["message"], body
        assert stream_status == 200 and events[-1]["choices"][0]["finish_reason"] == "error", events
        # a fatal failure of the step: every request in it ends with an error, then the server stops
        for status, events in asyncio.run(_fatal_beside_a_running_stream(url)):
            assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "error", events
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 1, text
    assert "the step failed on purpose" in text and "Traceback" not in text, text


async def _fatal_beside_a_running_stream(url: str) -> list:
    """A long stream runs (its first event has arrived) when the FATAL request joins it; both answers."""
    async with httpx.AsyncClient(timeout=120) as client:
        body = dict(prompt="Hello world", max_tokens=90, temperature=0, stream=True)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        fatal = await _ask(client, url, dict(prompt=FATAL, max_tokens=40, stream=True))
        return [(r.status_code, events), fatal]


def test_the_message_channel_reads_every_message_that_has_arrived_at_once():
    import socket
    import threading

    from mmtrain.inference.engine_client import MessageChannel

    mine, theirs = socket.socketpair()
    sender, receiver = MessageChannel(mine), MessageChannel(theirs)
    sent = [("submit", i, list(range(i)), None) for i in range(5)] + [("big", "x" * (3 << 20))] + [("cancel", 9)]
    for message in sent[:5]:
        sender.send(message)
    assert receiver.receive() == sent[:5]  # five messages, one read
    writer = threading.Thread(target=lambda: [sender.send(m) for m in sent[5:]])  # larger than one read
    writer.start()
    got = []
    while len(got) < 2:
        got += receiver.receive()
    writer.join()
    assert got == sent[5:]
    sender.close()
    with pytest.raises(EOFError):
        receiver.receive()
    receiver.close()


def test_the_message_channel_builds_no_class_outside_its_allow_list():
    import pickle
    import socket

    from mmtrain.inference.engine_client import MessageChannel
    from mmtrain.inference.sampling import SamplingParams

    mine, theirs = socket.socketpair()
    sender, receiver = MessageChannel(mine), MessageChannel(theirs)
    sender.send(("submit", 1, [1, 2], SamplingParams(temperature=0.5)))
    assert receiver.receive() == [("submit", 1, [1, 2], SamplingParams(temperature=0.5))]
    sender.send(("submit", 2, [], socket.socket))  # any other class is refused, never built
    with pytest.raises(pickle.UnpicklingError, match="does not carry"):
        receiver.receive()
    sender.close()
    receiver.close()


def test_the_frontend_freezes_its_heap_before_it_says_ready(monkeypatch):
    """What start-up made (torch, FastAPI, the tokenizer) is frozen before the frontend serves, so a full collection
    walks only what serving makes (an unfrozen one stalled every request for 111 ms on the H200's host)."""
    from mmtrain.inference import frontend_process

    order = []
    monkeypatch.setattr(frontend_process, "freeze_heap", lambda: order.append("freeze"))

    class Client:
        class channel:
            send = staticmethod(lambda message: order.append(message))

        attach = staticmethod(lambda loop: order.append("attach"))

    class Server:
        async def serve(self, sockets):
            order.append("serve")

    asyncio.run(frontend_process._serve(Server(), Client(), None))
    assert order == ["attach", "freeze", (frontend_process.READY,), "serve"]
