"""Shared command-line shape and run sequence of the pretrain entry points: ``--config F.yaml key=value ...``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmtrain.config import ConfigError, load_config, save_config
from mmtrain.parallel import (
    LayoutError,
    ParallelDims,
    init_distributed,
    pick_device,
    shutdown_distributed,
)
from mmtrain.utils.log import setup_logging


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


def check_writable_run_dir(run_dir: str) -> None:
    """Create ``logging.run_dir`` and write a probe file in it (every rank writes checkpoints there); a
    ``ConfigError`` naming the key and the OS's reason otherwise, before any process group."""
    import tempfile

    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-check."):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"logging.run_dir={run_dir}: cannot write there ({reason}: {exc.filename or run_dir}); "
                          "choose a folder this user can write") from None


def run_entry(prog: str, cls: type, validate: Callable[..., None], train: Callable[[], Callable[..., Any]],
              argv: list[str] | None) -> int:
    """One pretrain entry point: parse -> validate -> processes and groups -> resolved config -> ``train()(cfg,
    mesh, device)``. ``train`` returns the training function (imported only once the config is valid). Exit codes:
    0 done, 2 a configuration/data/checkpoint error (one message, no traceback), 1 a collective timeout."""
    cfg = parse_run_config(cls, argv, prog)
    try:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        check_writable_run_dir(cfg.logging.run_dir)
    except (ConfigError, LayoutError) as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        return 2
    device = pick_device(cfg.train.device)
    rank, world_size = init_distributed(cfg.parallel.backend, device, cfg.parallel.collective_timeout_s)
    log = setup_logging(rank)
    try:
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build(timeout_s=cfg.parallel.collective_timeout_s)
        if rank == 0:
            save_config(cfg, Path(cfg.logging.run_dir) / "config.yaml")
        log.info(f"layout: {mesh.dims.describe()} on {device}; resolved config in {cfg.logging.run_dir}/config.yaml")
        from mmtrain.convert.checkpoint_io import ConvertError
        from mmtrain.data.blend_spec import BlendSpecError
        from mmtrain.data.index_cache import IndexCacheTimeout
        from mmtrain.data.splits import SplitError
        from mmtrain.train.checkpoint import CheckpointError
        from mmtrain.train.faults import CollectiveTimeout, NonFiniteError
        from mmtrain.utils.dcp_storage import CheckpointFormatError

        try:
            train()(cfg, mesh, device)
        except (CheckpointError, CheckpointFormatError, ConvertError, ConfigError, BlendSpecError, SplitError,
                IndexCacheTimeout, NonFiniteError) as exc:
            # stderr, like the config errors: one line per failing rank (a damaged file may fail one rank only)
            print(f"{'' if rank == 0 else f'[rank {rank}] '}{prog}: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except CollectiveTimeout as exc:
            log.error(f"error: {exc}")
            return 1
    finally:
        shutdown_distributed()
    return 0
