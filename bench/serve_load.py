"""The server under load: 32 concurrent streaming clients (spread over --client-processes processes), Llama-3.2-1B shapes (random weights), bf16, 128-token
prompts (token ids), 256 new tokens each, greedy.

    python bench/serve_load.py [--clients 32] [--prompt 128] [--new 256] [--no-compile] [--tiny] [--device cpu]

Starts ``python bench/serve_load.py --serve`` (the FastAPI app of ``mmtrain.serve`` over a random-weight model
with a token-id "tokenizer": text is the ids, so no tokenizer file is needed) in a child process, so the clients
do not share its interpreter; waits for /health; runs one warm-up round (compilation and CUDA-graph capture in
the engine thread), then the timed round. Reports throughput (new tokens/s over the round), time to first token
and per-token latency (gaps between a stream's tokens) percentiles; one JSON line, then a table.
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


def serve(a) -> None:
    import uvicorn

    from bench.generate import build_model
    from mmtrain.inference.engine import DecodeEngine
    from mmtrain.inference.openai_app import build_app
    from mmtrain.inference.server_engine import EngineThread

    device = torch.device(a.device)
    model = build_model(a.tiny, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    engine = EngineThread(DecodeEngine(model, a.clients, a.prompt + a.new, compile=not a.no_compile))
    engine.warmup()
    app = build_app(engine, IdsTokenizer(model.cfg.vocab_size), "bench")
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def _streams(url: str, prompts: list[list[int]], new: int) -> list[tuple[float, list[float]]]:
    """Stream one completion per prompt concurrently; per stream its start and each token's arrival time."""
    import httpx

    async def one(client, ids):
        t0 = time.perf_counter()
        stamps = []
        body = {"model": "bench", "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text = json.loads(line[6:])["choices"][0]["text"]
                    stamps += [time.perf_counter()] * len(text.split())  # one id per token
        return t0, stamps

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def _client_process(url: str, prompts: list[list[int]], new: int, start_at: float):
    """One client process's streams, started at ``start_at`` (time.perf_counter is the system's monotonic
    clock on Linux: the same in every process)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    return asyncio.run(_streams(url, prompts, new))


def _round(pool, procs: int, url: str, clients: int, prompt: int, new: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab - 1, (clients, prompt), generator=g).tolist()
    start = time.perf_counter() + 0.5
    futures = [pool.submit(_client_process, url, prompts[i::procs], new, start) for i in range(procs)]
    results = [r for f in futures for r in f.result()]
    end = max((s[-1] for _, s in results if s), default=start)
    tokens = sum(len(s) for _, s in results)
    ttft = [s[0] - t0 for t0, s in results if s]
    gaps = [b - a for _, s in results for a, b in zip(s, s[1:])]
    ms = lambda xs, q: round(1000 * _pct(xs, q), 2)  # noqa: E731
    return {"system": "mmtrain-serve", "clients": clients, "client_processes": procs, "prompt": prompt,
            "new_tokens": new, "completion_tokens": tokens, "all_answered": all(len(s) == new for _, s in results),
            "s": round(end - start, 3), "tokens_per_s": round(tokens / (end - start)),
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90), "ttft_ms_p99": ms(ttft, 99),
            "token_ms_p50": ms(gaps, 50), "token_ms_p90": ms(gaps, 90), "token_ms_p99": ms(gaps, 99),
            "token_ms_mean": round(1000 * statistics.fmean(gaps), 2) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--warmup-new", type=int, default=16, help="new tokens per request of the warm-up round")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny model (a CPU check of the script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--client-processes", type=int, default=4,
                    help="processes the clients are spread over (one Python process parsing every stream's "
                         "events falls behind the server; real clients are many processes)")
    a = ap.parse_args()
    if a.serve:
        return serve(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_args = [sys.executable, __file__, "--serve", "--port", str(port), "--clients", str(a.clients),
                  "--prompt", str(a.prompt), "--new", str(a.new), "--device", a.device]
    child_args += ["--tiny"] * a.tiny + ["--no-compile"] * a.no_compile
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
            row = _round(pool, procs, url, a.clients, a.prompt, a.new, vocab, seed=2)
        row["warmup_s"] = round(warm, 1)
        print(json.dumps(row), flush=True)
        print("\n| clients (processes) | new tokens/s | TTFT p50/p90/p99 ms | per-token p50/p90/p99 ms |\n|---|---|---|---|")
        print(f"| {row['clients']} ({row['client_processes']}) | {row['tokens_per_s']} | {row['ttft_ms_p50']} / {row['ttft_ms_p90']} / "
              f"{row['ttft_ms_p99']} | {row['token_ms_p50']} / {row['token_ms_p90']} / {row['token_ms_p99']} |")
    finally:
        child.terminate()
        child.wait(timeout=30)


if __name__ == "__main__":
    main()
