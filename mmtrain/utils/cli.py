"""Command-line pieces the small entry points share (``mmtrain.generate``, ``mmtrain.serve``)."""

from __future__ import annotations

import argparse
import sys


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument error is one line naming the program, then exit 2 (argparse would print the usage first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
