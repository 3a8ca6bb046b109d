"""The server tensor-parallel: ``torchrun --nproc_per_node 2 -m mmtrain.serve`` (rank 0 serves, rank 1 repeats its
model calls) answers concurrent requests with the one-process server's greedy answers, reports the model and its
chat template, refuses bad requests and keeps serving, and stops cleanly on SIGTERM to rank 0. A rank that goes
away stops the others within their timeout instead of hanging them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from mmtrain.testing import free_port, run_distributed  # noqa: E402
from tests.inference_helpers import tiny_checkpoint, tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown", "Hello world", "Numbers 123", "Café", "def f(x):", "lazy dog", "hello server", "x"]
REQUESTS = [dict(prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // 8), max_tokens=4 + (i * 7) % 23) for i in range(12)]
CHAT = dict(messages=[{"role": "user", "content": "Hello"}], max_tokens=8)


def _start_tp2(ckpt: Path, tok: Path, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--monitor-interval=0.2", "-m", "mmtrain.serve", "--ckpt", str(ckpt), "--tokenizer", str(tok),
           "--port", "0", "--slots", "8", "--context", "96", "--device", "cpu", "--model-name", "tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _complete(client: httpx.Client, url: str, requests: list[dict]) -> list[str]:
    return [client.post(f"{url}/v1/completions", json={"model": "tiny", "temperature": 0, **r})
            .json()["choices"][0]["text"] for r in requests]


def _answers(url: str) -> tuple[list[str], str]:
    """Each request alone (greedy), and the chat answer."""
    with httpx.Client(timeout=60) as client:
        chat = client.post(f"{url}/v1/chat/completions", json={"model": "tiny", "temperature": 0, **CHAT})
        return _complete(client, url, REQUESTS), chat.json()["choices"][0]["message"]["content"]


def _one_process_answers(ckpt: Path, tok: Path) -> tuple[list[str], str]:
    """The one-process server's answers, in this process (one intra-op thread, as the TP ranks have: two threads
    beside the starting ranks on a small machine cost ten times the CPU in spinning)."""
    import torch

    from mmtrain.serve import build_server_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _serve_one_process(build_server_app(ckpt, tok, model_name="tiny", slots=8, context=96, device="cpu"))
    finally:
        torch.set_num_threads(threads)


def _serve_one_process(built) -> tuple[list[str], str]:
    app, engine = built
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return _answers(f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.close()


async def _concurrent(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(REQUESTS))) as client:
        async def one(r, i):
            body = {"model": "tiny", "temperature": 0, **r}
            if i % 2:  # half of them stream
                text = []
                async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(text)
            return (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]["text"]
        return await asyncio.gather(*(one(r, i) for i, r in enumerate(REQUESTS)))


def _wait_ready(client: httpx.Client, proc: subprocess.Popen, log_path: Path, timeout_s: float = 180) -> str:
    """The server's URL, once it answers: ``--port 0`` lets it pick a free port and name it in its log (a port
    picked here and bound there later can be taken in between, by this test's own one-process server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the TP2 server exited ({proc.returncode}):\n{log_path.read_text()}")
        found = re.search(r"serving 'tiny' on (http://\S+) ", log_path.read_text())
        try:
            if found and client.get(f"{found.group(1)}/health").status_code == 200:
                return found.group(1)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the TP2 server did not start in {timeout_s} s:\n{log_path.read_text()}")


def test_tp2_server_answers_as_one_process_and_stops_cleanly(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log, httpx.Client(timeout=60) as client:
        proc = _start_tp2(ckpt, tok, log)
        try:
            single, chat = _one_process_answers(ckpt, tok)  # while the TP2 ranks start
            url = _wait_ready(client, proc, log_path)
            assert [m["id"] for m in client.get(f"{url}/v1/models").json()["data"]] == ["tiny"]
            assert asyncio.run(_concurrent(url)) == single
            openai = pytest.importorskip("openai")
            out = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
                model="tiny", temperature=0, **CHAT)
            assert out.choices[0].message.content == chat  # the tokenizer's chat template, on rank 0
            for body, message in [(b'{"prompt": "x", "bogus": 1}', "bogus: unknown field"),
                                  (b'{"prompt": "x", "max_tokens": 96}', "exceeds the context of 96"),
                                  (b'{"prompt": [1, 99999], "max_tokens": 2}', "token ids must be in 0..511"),
                                  (b'{"prompt": "x", ', "not valid JSON")]:
                r = client.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
            assert _complete(client, url, REQUESTS[:2]) == single[:2]  # still serving, in step with rank 1
            pid = int(re.search(r"serving 'tiny' on \S+ \(pid (\d+), tensor-parallel over 2 ranks\)",
                                log_path.read_text()).group(1))
            os.kill(pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()


def _lost_peer(rank: int, world_size: int) -> str:
    """Rank 0 stays silent on channel A: rank 1's ``follow`` gives up after A's timeout and rank 1 leaves. Then
    rank 0 serves on channel B: its first heartbeat to the departed rank fails, which is fatal (requests are
    refused, ``on_fatal`` is called) instead of a hang."""
    from mmtrain.inference.engine import DecodeEngine, Sequence
    from mmtrain.inference.sampling import SamplingParams
    from mmtrain.inference.server_engine import EngineStopped, EngineThread
    from mmtrain.inference.step_broadcast import PeerLostError, StepChannel, StepLeader, follow
    from mmtrain.parallel import ParallelDims
    from tests.inference_helpers import tiny_model

    mesh = ParallelDims(2, tp=2).build()
    silent, lost = StepChannel(mesh, timeout_s=2.0), StepChannel(mesh, timeout_s=2.0)
    engine = DecodeEngine(tiny_model(), 2, 32, peers=StepLeader(lost) if rank == 0 else None)
    if rank == 1:
        try:
            follow(engine, silent)
        except PeerLostError as exc:
            return str(exc)
        return "followed"
    time.sleep(4)  # rank 1 times out meanwhile, and exits
    fatal = threading.Event()
    served = EngineThread(engine, on_fatal=lambda message: fatal.set())
    assert fatal.wait(60)
    try:
        served.submit(Sequence([5], SamplingParams(2)))
    except EngineStopped as exc:
        return str(exc)
    return "accepted"


def test_a_lost_rank_stops_the_others_instead_of_hanging():
    leader, follower = run_distributed(_lost_peer, 2, timeout_s=120)
    assert follower.startswith("the server rank 0 sent nothing for 2 s or went away"), follower
    assert "stopped answering the server rank 0" in leader and "the server shuts down" in leader, leader
