"""A ``python`` for the docs' commands that starts in milliseconds: each ``python -m MOD ...``, ``python -c CODE ...``
or ``python FILE ...`` a page runs is forked from a server that has torch and the other third-party packages
imported once, instead of importing them again (~3 s of CPU each: most of the docs tests' time on the 2-core
CI machine, with ~90 commands). The command still runs as written: bash runs it, in the page's folder, with its
environment, arguments, stdin/stdout/stderr, exit status and signals; only the interpreter's start-up is shared.

    server:  python tests/docs/python_server.py serve SOCKET        (tests/docs/doc_runner.py starts it)
    shim:    PATH's ``python``/``python3``: python -I -S tests/docs/python_server.py run ARGS...

The shim hands the command to the server when it can (its PYTHON* environment and PYTHONPATH equal to the
server's, no interpreter options) and otherwise execs the real interpreter, so nothing else changes. The server
forks a supervisor per command, which forks the command in a new session and reports its end; when the shim goes
(it exited, or the page's process group was killed), the supervisor kills the command's session.

Only third-party modules are preloaded: a page may edit mmtrain's code (docs/adding-a-model-family.md), so mmtrain
is imported by each command, from the code the command sees. Test-suite infrastructure only: nothing in mmtrain
imports it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

_PRELOAD = ("torch", "torch.distributed", "numpy", "yaml", "sentencepiece", "safetensors.torch", "transformers")
_HANDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> dict | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = b""
    while len(chunks) < n:
        part = sock.recv(n - len(chunks))
        if not part:
            return None
        chunks += part
    return chunks


# ----------------------------------------------------------------------------------------------------- the shim
# what bash sets by itself, torchrun's free port (doc_runner.guide_env picks one per page) and the name of the
# running test (pytest sets it in its process for each test)
_IGNORED = {"PWD", "OLDPWD", "SHLVL", "_", "PET_MASTER_PORT", "PYTEST_CURRENT_TEST"}


def environment_key(env) -> str:
    """A command is served only where its whole environment (but the variables above) is the server's: the
    preloaded modules read theirs when the server imported them."""
    import hashlib

    kept = sorted((k, v) for k, v in env.items() if k not in _IGNORED and not k.startswith("MMTRAIN_PYTHON_"))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def shim(args: list[str]) -> None:
    real = os.environ.get("MMTRAIN_PYTHON_REAL", "")
    served = (os.environ.get("MMTRAIN_PYTHON_SERVER") and args and (args[0] in ("-m", "-c") and len(args) > 1
              or not args[0].startswith("-"))
              and environment_key(os.environ) == os.environ.get("MMTRAIN_PYTHON_SERVER_KEY"))
    sock = None
    if served:
        header = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.environ["MMTRAIN_PYTHON_SERVER"])  # refused until the server has imported
            socket.send_fds(sock, [struct.pack("!I", len(header)) + header], [0, 1, 2])  # EBADF: one is closed
        except OSError:
            sock = None
    if sock is None:
        os.execv(real, [real, *args])
    for sig in _HANDED_SIGNALS:  # e.g. the page's `kill %1`: the command gets it, as it would with no shim
        signal.signal(sig, lambda signum, frame: _send(sock, {"signal": signum}))
    while True:
        try:
            end = _recv(sock)
        except InterruptedError:
            continue
        if end is None:
            sys.exit(1)
        if "exit" in end:
            sys.exit(end["exit"])
        if "killed_by" in end:  # the command died of a signal: so does the shim, for its caller's status
            for sig in _HANDED_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(end["killed_by"], signal.SIG_DFL)
            os.kill(os.getpid(), end["killed_by"])
            sys.exit(128 + end["killed_by"])


# ---------------------------------------------------------------------------------- in the test process
_SERVERS: dict[str, str] = {}  # environment key -> socket path
_SHIMS: list[str] = []


def with_python_server(env: dict[str, str]) -> dict[str, str]:
    """``env`` with PATH's ``python``/``python3`` the shim, served by a server made for exactly this environment
    (one per environment per test process, started here without waiting: until it listens, the shim runs the real
    interpreter; it stops when this process exits)."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    if not _SHIMS:
        folder = tempfile.mkdtemp(prefix="mmpy-")
        atexit.register(shutil.rmtree, folder, True)
        for name in ("python", "python3"):
            shim = os.path.join(folder, name)
            with open(shim, "w") as f:
                f.write(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{os.path.abspath(__file__)}" run "$@"\n')
            os.chmod(shim, 0o755)
        _SHIMS.append(folder)
    env = {**env, "PATH": _SHIMS[0] + os.pathsep + env.get("PATH", ""), "MMTRAIN_PYTHON_REAL": sys.executable}
    key = environment_key(env)
    if key not in _SERVERS:
        path = os.path.join(_SHIMS[0], f"server-{len(_SERVERS)}")
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        atexit.register(server.kill)
        _SERVERS[key] = path
    return {**env, "MMTRAIN_PYTHON_SERVER": _SERVERS[key], "MMTRAIN_PYTHON_SERVER_KEY": key}


# --------------------------------------------------------------------------------------------------- the server
def serve(path: str) -> None:
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - a missing package is imported by the command, or fails there
            continue
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    while os.getppid() == parent:  # the test process that started it is gone: stop
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # finished supervisors
                pass
        except ChildProcessError:
            pass
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _supervise(conn)  # never returns
        conn.close()


def _supervise(conn: socket.socket) -> None:
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
        size = struct.unpack("!I", msg[:4])[0]
        body = msg[4:] + (_recv_exact(conn, size - len(msg) + 4) or b"")
        request = json.loads(body)
    except Exception:  # noqa: BLE001 - a shim that went away
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    status = None
    alive = True
    while status is None:
        if alive and select.select([conn], [], [], 0.05)[0]:
            message = _recv(conn)
            if message is None:  # the shim is gone: so is its command, as with a killed process group
                alive = False
                _kill_session(pid)
            elif "signal" in message:
                try:
                    os.kill(pid, message["signal"])
                except ProcessLookupError:
                    pass
        elif not alive:
            os.waitpid(pid, 0)
            os._exit(0)
        done, status_word = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_word
    _kill_session(pid)  # what the command left running in the background ends with it
    try:
        if os.WIFSIGNALED(status):
            _send(conn, {"killed_by": os.WTERMSIG(status)})
        else:
            _send(conn, {"exit": os.WEXITSTATUS(status)})
    except OSError:
        pass
    os._exit(0)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _command(request: dict, fds: list[int]) -> None:
    """In the forked command process: become the command as ``python ARGS`` would start it, run it, exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        code = _run(request["args"])
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _finish(code)


def _run(args: list[str]) -> int:
    import builtins
    import runpy
    import types

    main = types.ModuleType("__main__")  # a fresh __main__, not the server's
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code_path = os.environ.get("PYTHONPATH", "")
    extra = [p for p in code_path.split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in extra]
    if args[0] == "-m":
        sys.argv = ["-m", *args[2:]]
        sys.path[:] = [os.getcwd(), *extra, *base]
        runpy._run_module_as_main(args[1], alter_argv=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = ["", *extra, *base]
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(args)
        sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *extra, *base]
        runpy.run_path(args[0], run_name="__main__")
    return 0


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed pipe
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        shim(sys.argv[2:])
