"""Shared command-line shape of the pretrain entry points: ``--config F.yaml key=value ...``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mmtrain.config import ConfigError, load_config


def parse_run_config(cls: type, argv: list[str] | None, prog: str) -> Any:
    ap = argparse.ArgumentParser(prog=prog, description="Overrides are dotted key=value pairs, e.g. optim.lr=1e-4.")
    ap.add_argument("--config", default=None, help="YAML file overlaying the defaults (may include: others)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return load_config(cls, args.config, args.overrides)
    except ConfigError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
