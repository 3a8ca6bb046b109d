"""Where the server's host time goes under bench/serve_load.py's load: CPU time per new token of each thread of
the server (the engine's process and the frontend's, or the one process of ``--in-process``), and
(``--cprofile``) the split of the event loop's and the engine thread's time by part.

    python bench/serve_profile.py [--tiny] [--device cpu] [--null-model] [--in-process] [--cprofile [--top N]]

The server child is serve_load.py's. Around the timed round the parent reads every thread's CPU time and
run-queue wait from /proc/PID/task/TID/schedstat (the kernel's own counters: nothing runs in the server to take
them), so those numbers are an unprofiled server's. The child names its engine thread and the event loop's
process in a file. ``--cprofile`` also runs cProfile in the engine thread and the event loop during the timed
round (SIGUSR1 / SIGUSR2 from the parent start and stop it) and prints each one's time by part (``PARTS``):
socket calls, uvicorn + h11, Starlette/FastAPI, asyncio, our SSE code, the handoff from the engine to the event
loop, the engine's bookkeeping, detokenization, the model. cProfile slows what it profiles and counts a call that waits for the interpreter lock (a torch op,
a socket write) as that call's time: read its split as shares, and as a sign of lock waits where such calls
look long.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import serve_load  # noqa: E402

# (part, substrings of a function's file:name), first match wins; a function's own time (tottime) is counted
PARTS = [
    ("socket send/recv calls", ("'send' of '_socket", "'sendall' of '_socket", "'recv' of '_socket")),
    ("detokenize", ("inference/detokenize.py", "IdsTokenizer", "core/tokenizer.py", "tokenizers")),
    ("engine -> loop handoff", ("server_engine.py", "engine_client.py", "frontend_process.py", "pickle",
                                "call_soon_threadsafe", "_write_to_self")),
    ("engine bookkeeping", ("inference/engine.py", "inference/sampling.py")),
    ("model step (torch)", ("torch", "inference/decoder.py", "mmtrain/models", "mmtrain/model/", "serve_load.py")),
    ("SSE + JSON (openai_app)", ("openai_app.py", "json", "uuid")),
    ("asyncio loop, tasks, futures", ("asyncio", "selectors", "select", "epoll", "_contextvars")),
    ("starlette / fastapi", ("starlette", "fastapi")),
    ("anyio", ("anyio",)),
    ("uvicorn + h11", ("uvicorn", "h11")),
]


def _part(func: tuple) -> str:
    where = f"{func[0]}:{func[2]}"
    for name, keys in PARTS:
        if any(k in where for k in keys):
            return name
    return "other"


def _profile_on_signals(path: str, prof: cProfile.Profile) -> None:
    """SIGUSR1 starts ``prof`` in this process's main thread, SIGUSR2 stops it and writes ``path``."""
    def start(*_):
        prof.enable()

    def stop(*_):
        prof.disable()
        prof.dump_stats(path)
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def profiled_frontend_parts(thread_file: str, cprofile: bool, vocab: int):
    """serve_load's frontend parts, in the frontend's process: with ``cprofile`` its event loop is profiled too."""
    if cprofile:
        _profile_on_signals(thread_file + ".loop.prof", cProfile.Profile())
    return serve_load.ids_frontend_parts(vocab)


def serve_profiled(a) -> None:
    """The child: serve_load's server; its threads named in ``a.thread_file``; cProfile on SIGUSR1 / SIGUSR2."""
    engine_prof = cProfile.Profile()
    want = {"on": False}
    state = {"engine": False}

    def on_ready(engine, frontend_pid: int) -> None:
        step = engine.engine.step

        def profiled_step():  # runs in the engine thread: switch its profiler there
            if want["on"] != state["engine"]:
                (engine_prof.enable if want["on"] else engine_prof.disable)()
                state["engine"] = want["on"]
            return step()
        if a.cprofile:
            engine.engine.step = profiled_step
        Path(a.thread_file).write_text(json.dumps({
            "engine thread": [os.getpid(), engine._thread.native_id],
            "engine process's main thread (requests in)": [os.getpid(), os.getpid()],
            "event loop": [frontend_pid, frontend_pid]}))

    if a.cprofile:
        loop_prof = cProfile.Profile()

        def start(*_):
            want["on"] = True
            if a.in_process:
                loop_prof.enable()

        def stop(*_):
            want["on"] = False
            if a.in_process:
                loop_prof.disable()
                loop_prof.dump_stats(a.thread_file + ".loop.prof")
            threading.Timer(1.0, lambda: engine_prof.dump_stats(a.thread_file + ".engine.prof")).start()
        signal.signal(signal.SIGUSR1, start)
        signal.signal(signal.SIGUSR2, stop)
    serve_load.serve(a, parts=partial(profiled_frontend_parts, a.thread_file, a.cprofile), on_ready=on_ready)


def _schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (ns on a CPU, ns runnable but waiting for one)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            on, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            out[int(tid)] = (int(on), int(wait))
        except (OSError, ValueError):
            pass
    return out


# waits, not work: the event loop's poll for I/O, the engine thread's wait for new requests
_WAITS = ("method 'poll' of 'select.epoll'", "method 'acquire' of '_thread.lock'", "method 'select' of")


def _split(path: str) -> list[tuple[str, float]]:
    stats = pstats.Stats(path).stats
    by_part: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in stats.items():
        if any(w in func[2] for w in _WAITS):
            continue
        by_part[_part(func)] = by_part.get(_part(func), 0.0) + tottime
    whole = sum(by_part.values()) or 1.0
    return sorted(((k, v / whole) for k, v in by_part.items()), key=lambda kv: -kv[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serve_load.add_options(ap)
    ap.add_argument("--cprofile", action="store_true", help="also split the two threads' time by part (cProfile)")
    ap.add_argument("--top", type=int, default=0,
                    help="with --cprofile: also print each thread's N costliest functions")
    ap.add_argument("--thread-file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_profiled(a)
    thread_file = a.thread_file or tempfile.mktemp(prefix="serve_threads_", suffix=".json")
    extra = ["--thread-file", thread_file] + ["--cprofile"] * a.cprofile
    marks = {}

    def pids() -> set[int]:
        return {pid for pid, _ in json.loads(Path(thread_file).read_text()).values()}

    def before(child_pid: int) -> None:
        marks["before"] = {pid: _schedstat(pid) for pid in pids()}
        if a.cprofile:
            for pid in pids():
                os.kill(pid, signal.SIGUSR1)

    def after(child_pid: int) -> None:
        marks["after"] = {pid: _schedstat(pid) for pid in pids()}
        if a.cprofile:
            for pid in pids():
                os.kill(pid, signal.SIGUSR2)
            time.sleep(3)
    row = serve_load.run(a, Path(__file__), extra, before, after)
    print(json.dumps(row), flush=True)
    names = {(pid, tid): name for name, (pid, tid) in json.loads(Path(thread_file).read_text()).items()}
    tokens = row["completion_tokens"]
    cpu: dict[str, list[float]] = {}
    for pid, threads in marks["after"].items():
        for tid, (on, wait) in threads.items():
            on0, wait0 = marks["before"][pid].get(tid, (0, 0))
            name = names.get((pid, tid), f"other threads of pid {pid} (torch workers, to_thread)")
            acc = cpu.setdefault(name, [0.0, 0.0])
            acc[0] += (on - on0) / 1e3 / tokens
            acc[1] += (wait - wait0) / 1e3 / tokens
    wall_us = 1e6 * row["s"] / tokens
    layout = "one process" if a.in_process else "engine process + frontend process"
    print(f"\nserver ({layout}), per new token (wall {wall_us:.1f} µs per token over the round):")
    print("| thread | CPU µs/token | run-queue wait µs/token |\n|---|---|---|")
    for name, (on, wait) in sorted(cpu.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {on:.1f} | {wait:.1f} |")
    print(f"| all | {sum(v[0] for v in cpu.values()):.1f} | {sum(v[1] for v in cpu.values()):.1f} |")
    if a.cprofile:
        _print_profiles(a, thread_file, cpu)
    if a.thread_file is None:  # ours: leave nothing behind
        for suffix in ("", ".loop.prof", ".engine.prof"):
            Path(thread_file + suffix).unlink(missing_ok=True)


def _print_profiles(a, thread_file: str, cpu: dict) -> None:
    for name, suffix in (("event loop", ".loop.prof"), ("engine thread", ".engine.prof")):
        path = thread_file + suffix
        if not os.path.exists(path):
            print(f"(no profile of the {name})")
            continue
        print(f"\n{name}: share of its profiled time by part (x its CPU µs/token, unprofiled)")
        print("| part | share | ≈ µs/token |\n|---|---|---|")
        for part, share in _split(path):
            print(f"| {part} | {100 * share:.0f}% | {share * cpu.get(name, [0.0])[0]:.1f} |")
        if a.top:
            pstats.Stats(path).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
