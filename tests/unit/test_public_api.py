"""The public API resolves, every entry is documented, and importing mmtrain stays cheap."""

from __future__ import annotations

import subprocess
import sys

import mmtrain


def test_every_public_name_resolves_and_has_a_docstring():
    for name in mmtrain.__all__:
        obj = getattr(mmtrain, name)
        assert (obj.__doc__ or "").strip(), f"mmtrain.{name} has no docstring"


def test_import_mmtrain_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, mmtrain; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_every_subpackage_lists_documented_public_names():
    import importlib

    for sub in ("core", "config", "parallel", "model", "data", "train", "convert", "quantize"):
        pkg = importlib.import_module(f"mmtrain.{sub}")
        assert (pkg.__doc__ or "").strip() and pkg.__all__, f"mmtrain.{sub} has no docstring or __all__"
        for name in pkg.__all__:
            obj = getattr(pkg, name)
            if not isinstance(obj, (tuple, list, dict)):
                assert (obj.__doc__ or "").strip(), f"mmtrain.{sub}.{name} has no docstring"


def test_importing_the_data_model_and_train_packages_does_not_import_torch():
    code = "import sys, mmtrain.core, mmtrain.data, mmtrain.model, mmtrain.train; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
