"""Markers by folder (unit / distributed / gpu); GPU tests skip cleanly without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

_KINDS = ("unit", "distributed", "gpu")


def pytest_sessionstart(session):
    # the distributed tests' ranks fork from a server that imports torch and mmtrain once; it does that on the
    # other core while this process collects
    from mmtrain.testing import start_rank_server

    start_rank_server()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in _KINDS:
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
