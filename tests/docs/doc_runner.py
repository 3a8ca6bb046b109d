"""Running a Markdown page's blocks (tests/docs/guide_blocks.py) in a folder, as its reader would: the shell
blocks in order with ``bash -euo pipefail``, the file blocks written first. Shared by the docs tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.docs.guide_blocks import page_blocks

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "user-guide.md"


def guide_env(code: Path = REPO) -> dict[str, str]:
    """This interpreter's environment first on PATH (python, torchrun, mmtrain-prep), the code of ``code`` (this
    tree, or a copy of its ``mmtrain/`` a page edits) first on PYTHONPATH.
    torchrun's rendezvous port (``PET_MASTER_PORT``, its ``--master-port`` default) is a free one, not 29500:
    the suite's other worker may be running a torchrun of its own at the same time.
    ``python`` starts its commands from a server with torch imported (tests/docs/python_server.py)."""
    from mmtrain.testing import free_port
    from tests.docs.python_server import with_python_server

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    bin_dir = str(Path(sys.executable).parent)
    return with_python_server({**env, "PATH": bin_dir + os.pathsep + env.get("PATH", ""), "PYTHONPATH": str(code),
                               "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())})


def run_page(page: Path, folder: Path, timeout: float = 300, code: Path = REPO) -> dict[int, str]:
    """Every block of ``page`` in ``folder`` (``code``: where its commands import mmtrain from); a failing command
    or an insert whose line is not in its file once fails the test naming the page's line. Returns each command
    block's stdout by the line the block starts at."""
    env = guide_env(code)
    outputs = {}
    for block in page_blocks(page.read_text(encoding="utf-8")):
        if block.kind == "file":
            (folder / block.file).parent.mkdir(parents=True, exist_ok=True)
            (folder / block.file).write_text(block.body, encoding="utf-8")
        elif block.kind == "insert":
            lines = (folder / block.file).read_text(encoding="utf-8").splitlines(keepends=True)
            at = [i for i, text in enumerate(lines) if block.after in text]
            assert len(at) == 1, (f"{page.relative_to(REPO)} line {block.line}: {block.file} has {len(at)} lines "
                                  f"holding {block.after!r}, not one")
            lines[at[0] + 1:at[0] + 1] = [block.body]
            (folder / block.file).write_text("".join(lines), encoding="utf-8")
        elif block.kind == "run":
            proc = _run_block(block.body, folder, env, timeout)
            assert proc.returncode == 0, (f"{page.relative_to(REPO)} line {block.line}: exit {proc.returncode}\n"
                                          f"{block.body}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                                          f"{proc.stderr[-3000:]}")
            outputs[block.line] = proc.stdout
    return outputs


def _run_block(body: str, folder: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """One block in its own process group, which is killed afterwards: a block that fails (or times out) after
    starting a server in the background leaves nothing running."""
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body], cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", f"timed out after {timeout} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def copy_folder(source: Path, target: Path) -> Path:
    """A private copy of a prepared folder (a page's commands may then write anything there)."""
    shutil.copytree(source, target, symlinks=True)
    return target
