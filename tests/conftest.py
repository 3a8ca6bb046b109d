"""Markers by folder (unit / distributed / gpu / docs); GPU tests skip cleanly without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

_KINDS = ("unit", "distributed", "gpu", "docs")


def pytest_sessionstart(session):
    # the distributed tests' ranks fork from a server that imports torch and mmtrain once; when they are about
    # to run, start it now so that it imports on the other core while this process collects
    distributed = Path(__file__).parent / "distributed"
    for arg in session.config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == distributed or distributed in path.parents or path in distributed.parents:
            from mmtrain.testing import start_rank_server

            start_rank_server()
            return


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
