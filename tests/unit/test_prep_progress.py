"""`text` and `media` share one progress convention: --progress {auto,always,never}, --no-progress = never."""

from __future__ import annotations

import argparse
import io

import pytest

from dataprep import media, text
from dataprep.progress import progress_enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("module", [text, media])
def test_both_subcommands_take_the_same_flags(module):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    base = ["--input", "x", "--output-prefix" if module is text else "--output", "o"]
    base += ["--tokenizer", "t"] if module is text else []
    assert p.parse_args(base).progress == "auto"
    assert p.parse_args(base + ["--progress", "always"]).progress == "always"
    assert p.parse_args(base + ["--no-progress"]).progress == "never"
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--progress", "sometimes"])


def test_auto_draws_only_on_a_terminal():
    assert progress_enabled("auto", _Tty()) and not progress_enabled("auto", io.StringIO())
    assert progress_enabled("always", io.StringIO()) and not progress_enabled("never", _Tty())
