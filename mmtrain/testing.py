"""Run a function in N spawned processes over gloo: the harness of every CPU distributed test.

    def check(rank, world_size, scale):       # module-level, so spawn can import it
        ...
    results = run_distributed(check, 4, 2.0)   # one return value per rank

A rank that raises makes the whole call raise ``DistributedTestFailure`` carrying that rank's traceback
(the first failure in time, which is the root cause; peers that then die on broken collectives are listed
after it). Ranks still alive are killed after a short grace period, so a failure never hangs the suite.

Ranks start from a forkserver that has torch and mmtrain imported once (``_PRELOAD``): a spawned rank would
re-import them, ~3-5 s of CPU each, which was most of the CPU distributed suite's time on a 2-core machine.
Each rank still gets the caller's current environment, working directory and ``sys.path``, like spawn.
``MMTRAIN_TEST_START_METHOD=spawn`` switches back to plain spawn.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


class DistributedTestFailure(AssertionError):
    pass


# Imported once in the forkserver, before any rank forks from it. Only imports: nothing in the server starts a
# thread pool or a process group, so forking it is safe. A module that fails to import is skipped there.
# Besides the trainer: what many ranks would otherwise each import again (CPU s a rank, 2-core dev machine):
# torch.compile's autograd tracing (0.4, the compiled-block tests), energon and the VLM loader (1.0, the VLM
# runs) and transformers' top level (1.0, the HF-bridge tests' modules import it).
_PRELOAD = ["torch", "torch.distributed", "mmtrain.train.loop", "mmtrain.testing", "torch._functorch.aot_autograd",
            "megatron.energon", "mmtrain.data.multimodal_loader", "mmtrain.train.vlm_train", "transformers"]


def _context():
    method = os.environ.get("MMTRAIN_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use only)
    return ctx


def capture_log_messages() -> list[str]:
    """From now on, every log record's message (INFO and up, from the root and every existing logger) is
    appended to the returned list: for rank functions that check what a run logged."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: messages.append(r.getMessage())
    for name in ["", *logging.root.manager.loggerDict]:
        logging.getLogger(name).addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    return messages


def start_rank_server() -> None:
    """Start the forkserver now, so that its imports overlap with other work (the test session calls this
    before collecting); ``run_distributed`` starts it otherwise."""
    if os.environ.get("MMTRAIN_TEST_START_METHOD", "forkserver") == "forkserver":
        from multiprocessing import forkserver

        _context()
        forkserver.ensure_running()


def free_port() -> int:
    """A port free now, for a process started next to bind (torchrun's ``--master_port``). It is drawn below the
    system's ephemeral range: a port the kernel hands out for ``bind(0)`` or an outgoing connection (gloo's
    pairs, another test's server) would be free to be taken again before the process binds it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(50 if low > 2048 else 0):  # a few tries; then any free port, as before
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result_globals() -> list:
    """What numpy values need beyond torch's weights-only set: the array and scalar constructors (which build
    values from bytes, calling nothing else) and ``numpy.dtype``, found from numpy itself (numpy 1 and 2 keep
    them in different modules)."""
    import numpy as np

    dtype_classes = sorted({type(np.dtype(code)) for code in np.typecodes["All"]}, key=str)  # numpy 2: per dtype
    return [np.ndarray, np.dtype, *dtype_classes, np.arange(1).__reduce__()[0], np.int64(0).__reduce__()[0]]


def load_result(payload: bytes) -> Any:
    """A rank's return value from its ``torch.save`` bytes: ``weights_only`` (tensors, numbers, strings, None,
    lists/tuples/dicts/sets of them) plus numpy arrays and scalars; anything else is refused."""
    with torch.serialization.safe_globals(_result_globals()):
        try:
            return torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - one line, not torch's page of advice
            why = [line for line in str(exc).splitlines() if line.startswith(("Trying", "Unsupported", "Can only"))]
            raise TypeError("a run_distributed function must return tensors, numbers, strings, None, numpy arrays "
                            f"and lists/tuples/dicts of them ({why[0] if why else type(exc).__name__})") from None


def _capture_output():
    """Point this rank's stdout and stderr (the file descriptors: C++ and child writes too) at a temporary file.
    A rank's logs and progress bars would otherwise reach the terminal around pytest's report, which captures
    only its own process; the file's tail goes into the report of a rank that fails."""
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    output = tempfile.TemporaryFile()
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    return output


def _output_tail(output, limit: int = 4000) -> str:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    output.seek(0, os.SEEK_END)
    output.seek(max(0, output.tell() - limit))
    text = output.read().decode("utf-8", "replace").strip()
    return f"\n--- the rank's output (last {limit} bytes)\n{text}" if text else ""


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, backend: str, results: Any,
            env: dict[str, str], pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # a forkserver child starts with the server's environment; use the caller's, as spawn did
    os.environ.update(env)
    output = _capture_output()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)  # N ranks on a 2-core machine: oversubscription makes gloo tests crawl
    try:
        import datetime

        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        value = fn(rank, world_size, *args)
        # Serialize to bytes: torch's queue pickling shares tensor storage through file descriptors, which
        # vanish when this process exits before the parent has read them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        load_result(buffer.getvalue())  # fails here, in the rank, on a value the parent would refuse
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "error", traceback.format_exc() + _output_tail(output)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - best effort while exiting
                pass


class _GroupSetupFailure(DistributedTestFailure):
    """The first failure was gloo's full-mesh connect inside ``init_process_group``, before ``fn`` ran."""


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 300.0,
                    env: dict[str, str] | None = None, pg_timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; returns the per-rank results.
    ``pg_timeout_s``: how long a collective may wait (the process group's timeout). A group whose gloo
    connections could not be set up (seen once, "Connection closed by peer", with two test workers starting
    groups at once) is started again, once: nothing of ``fn`` had run."""
    try:
        return _run_group(fn, world_size, args, backend, timeout_s, env, pg_timeout_s)
    except _GroupSetupFailure:
        return _run_group(fn, world_size, args, backend, timeout_s, env, pg_timeout_s)


def _run_group(fn: Callable, world_size: int, args: tuple, backend: str, timeout_s: float,
               env: dict[str, str] | None, pg_timeout_s: float) -> list[Any]:
    import datetime

    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    # The rendezvous store lives here, bound to a port the OS picks: no window in which another process can take a
    # port chosen in advance (EADDRINUSE on a busy machine).
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    port = store.port
    rank_env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, backend, results, rank_env, pg_timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    grace_deadline = None
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            limit = min(deadline, grace_deadline) if grace_deadline else deadline
            if now >= limit:
                break
            try:
                rank, status, payload = results.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in values and r not in [e[0] for e in errors]]
                for r in dead:  # crashed without reporting (segfault, os._exit, killed)
                    errors.append((r, f"process exited with code {procs[r].exitcode} without reporting"))
                if errors and grace_deadline is None:
                    grace_deadline = time.monotonic() + 10.0
                continue
            if status == "ok":
                values[rank] = load_result(payload)
            else:
                errors.append((rank, payload))
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + 10.0
    finally:
        for p in procs:
            p.join(timeout=0.1 if errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if errors:
        first_rank, first_tb = errors[0]
        others = ", ".join(str(r) for r, _ in errors[1:])
        more = f"\n(ranks {others} failed after it)" if others else ""
        setup = "init_process_group" in first_tb and "connectFullMesh failed" in first_tb
        raise (_GroupSetupFailure if setup else DistributedTestFailure)(
            f"rank {first_rank} of {world_size} failed:\n{first_tb}{more}")
    missing = [r for r in range(world_size) if r not in values]
    if missing:
        raise DistributedTestFailure(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f}s "
                                     "(a hang in a collective?)")
    return [values[r] for r in range(world_size)]
