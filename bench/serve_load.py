"""The server under load: 32 concurrent streaming clients (spread over --client-processes processes), Llama-3.2-1B
shapes (random weights), bf16, 128-token prompts (token ids), 256 new tokens each, greedy.

    python bench/serve_load.py [--clients 32] [--prompt 128] [--new 256] [--no-compile] [--tiny] [--device cpu]
                               [--in-process] [--null-model]

Starts ``python bench/serve_load.py --serve`` in a child process, laid out as ``python -m mmtrain.serve`` is (the
engine thread in the child, the FastAPI app in a frontend process it starts: ``mmtrain.inference.frontend_process``;
``--in-process``: the app beside the engine thread in the child) over a random-weight model with a token-id
"tokenizer" (text is the ids, so no tokenizer file is needed), so the clients do not share its interpreter; waits
for /health; runs one warm-up round (compilation and CUDA-graph capture in the engine thread), then the timed
round. Reports throughput (new tokens/s over the round), time to first token and per-token latency (gaps between
a stream's tokens) percentiles, and the SSE events received per token; one JSON line, then a table.
``--null-model``: the model's calls cost nothing, so what is measured is the serving path's own ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class IdsTokenizer:
    """Text is the token ids, space-separated (the bench sends ids and counts tokens, never reads words)."""

    def __init__(self, vocab: int) -> None:
        self.eod_id, self.max_id, self.vocab_size = None, vocab - 1, vocab

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)


def null_step_engine(model, slots: int, max_len: int):
    """A ``DecodeEngine`` whose model calls are replaced by "the next token is the last + 1": every host part of a
    step (sampling, stops, text, delivery) runs as usual, the model costs nothing, so what the server then delivers
    is the ceiling of its own serving path."""
    from mmtrain.inference.engine import DecodeEngine

    class NullStepEngine(DecodeEngine):
        def decode_forward(self) -> torch.Tensor:
            return _next_logits(self._last[:, 0], self.model.cfg.vocab_size)

        def prefill_forward(self, tokens_BS, slots_B, last_B) -> torch.Tensor:
            return _next_logits(tokens_BS[torch.arange(len(last_B)), last_B], self.model.cfg.vocab_size)

    return NullStepEngine(model, slots, max_len)


def _next_logits(tokens_B: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(tokens_B), vocab)
    logits[torch.arange(len(tokens_B)), (tokens_B + 1) % vocab] = 1.0
    return logits


def build_engine(a):
    """The child's ``EngineThread``: the bench model (or the null one), warmed up; and the model's vocabulary."""
    from bench.generate import build_model
    from mmtrain.inference.engine import DecodeEngine
    from mmtrain.inference.server_engine import EngineThread

    device = torch.device(a.device)
    model = build_model(a.tiny, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if a.null_model:
        engine = EngineThread(null_step_engine(model, a.clients, a.prompt + a.new))
    else:
        engine = EngineThread(DecodeEngine(model, a.clients, a.prompt + a.new, compile=not a.no_compile))
    engine.warmup()
    return engine, model.cfg.vocab_size


def ids_frontend_parts(vocab: int):
    """The frontend's (tokenizer, chat template): the token-id tokenizer, no template."""
    return IdsTokenizer(vocab), None


def serve(a, parts=ids_frontend_parts, on_ready=None) -> None:
    """The child: ``mmtrain.serve``'s layout (the app in a frontend process; ``parts`` builds its tokenizer there),
    or with ``--in-process`` the app and the engine thread in this process."""
    engine, vocab = build_engine(a)
    if a.trace:
        from bench.serve_trace import record_engine, traced_frontend_parts

        record_engine(engine.engine, a.trace)
        parts = partial(traced_frontend_parts, parts=parts, path=a.trace + ".frontend")
    listener = socket.create_server(("127.0.0.1", a.port), backlog=2048)
    try:
        if a.in_process:
            import uvicorn

            from mmtrain.inference.openai_app import build_app

            if on_ready is not None:
                on_ready(engine, os.getpid())
            app = build_app(engine, IdsTokenizer(vocab), "bench")
            uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
        else:
            from mmtrain.inference.frontend_process import serve_with_frontend

            serve_with_frontend(engine, IdsTokenizer(vocab).decode, partial(parts, vocab), "bench", 1 << 22,
                                listener, on_ready=on_ready and partial(on_ready, engine))
    finally:
        engine.close()
        listener.close()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def _streams(url: str, prompts: list[list[int]], new: int, start_at: float) -> list[tuple[float, list[float]]]:
    """Stream one completion per prompt concurrently from ``start_at`` on; per stream its start, each token's
    arrival time and the number of events that brought text."""
    import httpx

    async def one(client, ids):
        t0 = time.perf_counter()
        stamps, events = [], 0
        body = {"model": "bench", "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text = json.loads(line[6:])["choices"][0]["text"]
                    stamps += [time.perf_counter()] * len(text.split())  # one id per token
                    events += bool(text)
        return t0, stamps, events

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    # the client before the start: making one loads a TLS context (60-90 ms here, more on a busy host), which
    # after the start made streams late, counted against the server by tokens_per_s (late_ms_max)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # one request first: the first one through a client imports and builds its connection machinery (tens
        # of ms on the device's host), which at the start made this process's later streams late again
        (await client.get(f"{url}/health")).raise_for_status()
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return await asyncio.gather(*(one(client, p) for p in prompts))


def _client_process(url: str, prompts: list[list[int]], new: int, start_at: float):
    """One client process's streams, started at ``start_at`` (time.perf_counter is the system's monotonic
    clock on Linux: the same in every process)."""
    return asyncio.run(_streams(url, prompts, new, start_at))


_START_MARGIN_S = 1.0  # the common start of a round's streams, this long after the tasks go to the clients


def _round(pool, procs: int, url: str, clients: int, prompt: int, new: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab - 1, (clients, prompt), generator=g).tolist()
    start = time.perf_counter() + _START_MARGIN_S
    futures = [pool.submit(_client_process, url, prompts[i::procs], new, start) for i in range(procs)]
    results = [r for f in futures for r in f.result()]
    end = max((s[-1] for _, s, _ in results if s), default=start)
    tokens = sum(len(s) for _, s, _ in results)
    ttft = [s[0] - t0 for t0, s, _ in results if s]
    gaps = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    ms = lambda xs, q: round(1000 * _pct(xs, q), 2)  # noqa: E731
    return {"system": "mmtrain-serve", "clients": clients, "client_processes": procs, "prompt": prompt,
            "new_tokens": new, "completion_tokens": tokens, "all_answered": all(len(s) == new for _, s, _ in results),
            "tokens_per_event": round(tokens / max(1, sum(e for _, _, e in results)), 2),
            "s": round(end - start, 3), "tokens_per_s": round(tokens / (end - start)),
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90), "ttft_ms_p99": ms(ttft, 99),
            "token_ms_p50": ms(gaps, 50), "token_ms_p90": ms(gaps, 90), "token_ms_p99": ms(gaps, 99),
            "token_ms_mean": round(1000 * statistics.fmean(gaps), 2) if gaps else None,
            # the clients' own delay: how late the last stream was sent after the common start (a client-side
            # delay counts against tokens_per_s, which runs from the common start to the last token)
            "late_ms_max": round(1000 * (max(t0 for t0, _, _ in results) - start), 2),
            "start": start}  # the round's common start (time.perf_counter): where --trace's table begins


def add_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--warmup-new", type=int, default=16, help="new tokens per request of the warm-up round")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny model (a CPU check of the script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--null-model", action="store_true",
                    help="the model's calls cost nothing (next token = last + 1): the serving path's own ceiling")
    ap.add_argument("--in-process", action="store_true",
                    help="the app and the engine thread in one process (the frontend process's layout otherwise)")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="the server's two processes record their engine steps, prefills, requests and garbage "
                         "collections (bench/serve_trace.py: JSON to FILE and FILE.frontend); after the table, "
                         "what they did in the timed round's first --trace-ms")
    ap.add_argument("--trace-ms", type=float, default=400.0)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--client-processes", type=int, default=4,
                    help="processes the clients are spread over (one Python process parsing every stream's "
                         "events falls behind the server; real clients are many processes)")


def run(a, script: Path, child_extra: list[str] = (), before=None, after=None) -> dict:
    """Start ``script --serve`` (the server child), run the warm-up round and the timed one; ``before(pid)`` and
    ``after(pid)`` are called around the timed round. Returns its row."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_args = [sys.executable, str(script), "--serve", "--port", str(port), "--clients", str(a.clients),
                  "--prompt", str(a.prompt), "--new", str(a.new), "--device", a.device, *child_extra]
    child_args += ["--tiny"] * a.tiny + ["--no-compile"] * a.no_compile + ["--null-model"] * a.null_model
    child_args += ["--in-process"] * a.in_process + (["--trace", a.trace] if a.trace else [])
    child = subprocess.Popen(child_args, env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep
                                              + os.environ.get("PYTHONPATH", "")})
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + a.startup_timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (exit code {child.poll()})")
            time.sleep(0.5)
        vocab = 512 if a.tiny else 128256
        procs = max(1, min(a.client_processes, a.clients))
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            t0 = time.perf_counter()
            _round(pool, procs, url, a.clients, a.prompt, a.warmup_new, vocab, seed=1)  # also starts the workers
            warm = time.perf_counter() - t0
            if before is not None:
                before(child.pid)
            row = _round(pool, procs, url, a.clients, a.prompt, a.new, vocab, seed=2)
            if after is not None:
                after(child.pid)
        row["warmup_s"] = round(warm, 1)
        return row
    finally:
        child.terminate()
        child.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap)
    a = ap.parse_args()
    if a.serve:
        return serve(a)
    row = run(a, Path(__file__))
    print(json.dumps({k: v for k, v in row.items() if k != "start"}), flush=True)
    print("\n| clients (processes) | new tokens/s | TTFT p50/p90/p99 ms | per-token p50/p90/p99 ms "
          "| last stream sent late by ms |\n|---|---|---|---|---|")
    print(f"| {row['clients']} ({row['client_processes']}) | {row['tokens_per_s']} | {row['ttft_ms_p50']} / "
          f"{row['ttft_ms_p90']} / {row['ttft_ms_p99']} | {row['token_ms_p50']} / {row['token_ms_p90']} / "
          f"{row['token_ms_p99']} | {row['late_ms_max']} |")
    if a.trace:
        from bench.serve_trace import print_trace

        print_trace(a.trace, row["start"], a.trace_ms)


if __name__ == "__main__":
    main()
