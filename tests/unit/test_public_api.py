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
