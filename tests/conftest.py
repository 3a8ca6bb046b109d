"""Markers by folder (unit / distributed / gpu / docs); GPU tests skip cleanly without CUDA."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_KINDS = ("unit", "distributed", "gpu", "docs")


def _is_xdist_controller(config) -> bool:
    """This process hands the tests to pytest-xdist's workers and runs none itself."""
    return config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")


def _compile_sources() -> None:
    """Write the project's bytecode once. With PYTHONDONTWRITEBYTECODE set (the development machine sets it; CI's
    is said to be like it), every process the suite starts (the CLIs, the docs' commands: hundreds) would compile
    mmtrain's modules from source again, ~0.7 s each."""
    import compileall

    root = Path(__file__).parent.parent
    for folder in ("mmtrain", "dataprep", "tests"):
        compileall.compile_dir(root / folder, quiet=2, workers=1)


def _cache_rewritten_test_modules(config) -> None:
    """pytest's assertion rewriting of the test modules, written where pytest keeps it (``__pycache__``, checked
    against the source's mtime and size). pytest reads that cache even where it may not write it (with
    PYTHONDONTWRITEBYTECODE), so each worker otherwise rewrote all ~175 modules from source: 22 s of collection a
    worker against 12 s with the cache (2-core machine). Private pytest API: where it differs, pytest rewrites as
    before."""
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, assertstate_key, \
            get_cache_dir

        state = config.stash[assertstate_key]
    except (ImportError, KeyError):
        return
    here = Path(__file__).parent
    for fn in [*here.rglob("test_*.py"), *here.rglob("conftest.py")]:
        cache = get_cache_dir(fn)
        pyc = cache / (fn.name[:-3] + PYC_TAIL)
        if _read_pyc(fn, pyc) is None:
            cache.mkdir(exist_ok=True)
            _write_pyc(state, *_rewrite_test(fn, config)[::-1], pyc)


def _one_thread_per_core(config) -> None:
    """In a pytest-xdist worker: torch (OpenMP) threads = the cores over the workers (1 with ``-n auto``), in this
    process and the commands it starts, as the distributed tests' ranks and the docs' commands already run. With its
    default (every core) in each of N busy workers, a torch op's OpenMP threads wait for cores the other workers
    hold: on the 2-core machine the in-process unit tests took 1.45x as long. An OMP_NUM_THREADS already set wins."""
    if not hasattr(config, "workerinput") or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // int(config.workerinput.get("workercount", 1)))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pytest_configure(config):
    _one_thread_per_core(config)
    # pytest-xdist's --dist loadgroup otherwise queues the groups by their number of tests, most first: the docs
    # pages and the distributed files of one or two long tests then came last, and one worker ran them alone
    # while the other had finished. Kept off, the queue follows the workers' item order (_longest_groups_first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session):
    if sys.flags.dont_write_bytecode and not hasattr(session.config, "workerinput"):
        _compile_sources()  # in pytest-xdist's controller before it starts the workers, or in a run without them
        _cache_rewritten_test_modules(session.config)
    # the distributed tests' ranks fork from a server that imports torch and mmtrain once; when they are about
    # to run, start it now so that it imports on the other core while this process collects (not in pytest-xdist's
    # controller: it runs no test, and the imports would only take CPU from the workers' collection)
    if _is_xdist_controller(session.config):
        return
    distributed = Path(__file__).parent / "distributed"
    for arg in session.config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == distributed or distributed in path.parents or path in distributed.parents:
            from mmtrain.testing import start_rank_server

            start_rank_server()
            return


def pytest_collection_finish(session):
    # Collection imported torch, transformers, energon and every test module: ~900k objects that a full collection
    # then walks each time (energon's loader calls gc.collect() every few batches: most of some media tests'
    # time). Frozen, they are left out of every later collection; objects the tests make are still collected.
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    here = Path(__file__).parent
    for item in items:
        rel = Path(str(item.fspath)).relative_to(here)
        for kind in _KINDS:
            if kind == rel.parts[0]:
                item.add_marker(getattr(pytest.mark, kind))
        # for pytest-xdist's --dist loadgroup (the README's test command): a file's tests stay on one worker (its
        # module fixtures are built once); the docs pages spread over the workers, which share one user guide
        # folder (tests/docs/conftest.py: built once per run, under a file lock)
        item.add_marker(pytest.mark.xdist_group(rel.as_posix()))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # pytest-xdist's controller queues the groups in its workers' item order
        items[:] = _longest_groups_first(items, here)


# the shared user guide's build beside two busy workers: ~185 s in a measured run (61 s alone on the 2-core machine;
# the distributed tests' ranks take most of the CPU); docs pages started at ~100 s waited for it with a core idle
_GUIDE_LEAD_S = 200


def _longest_groups_first(items, here: Path) -> list:
    """The items by group (a file), the longest groups first (tests/group_seconds.json: seconds a file took in a
    measured run), so that the last groups the two workers take are short and they end together; the docs pages
    wait until the groups before them add up to the guide's build on both workers, as they start from the
    guide's folder (tests/docs/conftest.py), which the controller builds in the background meanwhile. Files not
    in the table (short or new) keep their collection order after the others."""
    import json

    seconds = json.loads((here / "group_seconds.json").read_text())
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(Path(str(item.fspath)).relative_to(here).as_posix(), []).append(item)
    measured = sorted((g for g in groups if g in seconds), key=lambda g: -seconds[g])
    docs = [g for g in measured if g.startswith("docs/")]
    order, ahead = [], 0.0
    for group in [g for g in measured if not g.startswith("docs/")]:
        order.append(group)
        ahead += seconds[group]
        while docs and ahead >= 2 * _GUIDE_LEAD_S:
            order.append(docs.pop(0))
    order += docs + [g for g in groups if g not in seconds]
    return [item for group in order for item in groups[group]]


_GUIDE_BUILDER = "_mmtrain_guide_builder"  # the config attribute holding the background build's process


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist there is no controller
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller, when the first worker has collected docs tests: build the user guide's folder
    that they share now, in the background (tests/docs/shared_guide.py), instead of a worker waiting idle for
    it later."""
    config = node.config
    if hasattr(config, _GUIDE_BUILDER) or not any(i.startswith("tests/docs/") for i in ids):
        return
    root = config._tmp_path_factory.getbasetemp()  # the workers' basetemp is a folder of it (as xdist sets)
    with open(root / "user_guide_shared.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.docs.shared_guide", str(root)], cwd=config.rootpath,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    setattr(config, _GUIDE_BUILDER, proc)


def pytest_sessionfinish(session):
    """A background guide build still running (the docs tests deselected or the run stopped early) is stopped:
    SIGTERM lets it stop the command it runs (tests/docs/shared_guide.py)."""
    proc = getattr(session.config, _GUIDE_BUILDER, None)
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
