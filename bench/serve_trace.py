"""``bench/serve_load.py --trace FILE``: what the server's two processes did in the timed round, from probes the
bench puts on the product's code (which is unchanged): in the engine's process each engine step and prefill
(``DecodeEngine.step`` / ``_prefill``), each submission its main thread hands to the engine thread
(``frontend_process._Frontend._handle``), every garbage collection; in the frontend's process each request it
sends to the engine (``ProcessEngineClient._submit``) and every garbage collection. Each process writes its events
(start, end, what; ``time.perf_counter``, one clock for all processes on Linux) as JSON when it exits: FILE and
FILE.frontend. ``print_trace`` prints the round's first milliseconds as a table, runs of the same event merged.
"""

from __future__ import annotations

import atexit
import gc
import json
import time


def _watch_gc(events: list, process: str) -> None:
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        elif 0 in started:
            events.append((started.pop(0), time.perf_counter(), f"{process}: gc gen{info['generation']}"))

    gc.callbacks.append(on_gc)


def _dump_at_exit(events: list, path: str) -> None:
    def dump():
        with open(path, "w") as f:
            json.dump(events, f)

    atexit.register(dump)  # both processes end normally when the bench terminates the server


def _timed(events: list, name: str, fn, info):
    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            events.append((t0, time.perf_counter(), name + info(*args)))
    return wrapper


def record_engine(engine, path: str) -> None:
    """In the engine's process: ``engine`` (its ``DecodeEngine``) steps and prefills, submissions, collections."""
    from mmtrain.inference import frontend_process

    events: list = []
    engine.step = _timed(events, "engine: step", engine.step,
                         lambda: f" (after: active={len(engine.active)} waiting={len(engine.waiting)})")
    engine._prefill = _timed(events, "engine: prefill", engine._prefill,
                             lambda seqs: f" B={len(seqs)} S={max(len(q.prompt_ids) for q in seqs)}")
    handle = frontend_process._Frontend._handle
    frontend_process._Frontend._handle = lambda self, message, *rest: _timed(
        events, "engine: got a message", lambda: handle(self, message, *rest), lambda: f" ({message[0]})")()
    _watch_gc(events, "engine")
    _dump_at_exit(events, path)


def traced_frontend_parts(vocab: int, parts, path: str):
    """In the frontend's process (``serve_with_frontend``'s ``parts``): its sends and collections, then ``parts``."""
    from mmtrain.inference import engine_client

    events: list = []
    submit = engine_client.ProcessEngineClient._submit
    engine_client.ProcessEngineClient._submit = _timed(events, "frontend: sent a request", submit,
                                                       lambda *args: "")
    _watch_gc(events, "frontend")
    _dump_at_exit(events, path)
    return parts(vocab)


def _load(path: str) -> list:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        print(f"(no trace in {path}: {exc})")
        return []


def print_trace(path: str, start: float, window_ms: float) -> None:
    """The timed round's first ``window_ms`` (ms from its common start): each event's start and length; a run of
    the same event, each starting within 2 ms of the one before (others between), is one row (xN); plain decode
    steps (under 3 ms, nothing waiting) are left out."""
    events = sorted(_load(path) + _load(path + ".frontend"))
    print(f"### trace: the server's processes in the timed round's first {window_ms:.0f} ms")
    print("| from start ms | ms | event |\n|---|---|---|")
    rows: list[list] = []  # [at, end, what, count, start of the last one]
    open_rows: dict[str, list] = {}  # the latest row of each event
    for t0, t1, what in events:
        at, end = (t0 - start) * 1e3, (t1 - start) * 1e3
        quiet = what.startswith("engine: step") and end - at < 3 and "waiting=0)" in what
        if not -50 <= at <= window_ms or quiet:
            continue
        row = open_rows.get(what)
        if row is not None and at - row[4] < 2:
            row[1], row[3], row[4] = max(row[1], end), row[3] + 1, at
        else:
            open_rows[what] = row = [at, end, what, 1, at]
            rows.append(row)
    for at, end, what, count, _ in rows:
        print(f"| {at:.1f} | {end - at:.2f} | {what}{f' x{count}' if count > 1 else ''} |")
