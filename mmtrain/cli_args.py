"""Shared command-line shape and run sequence of the pretrain entry points: ``--config F.yaml key=value ...``.

Nothing here imports torch before the command line is parsed and the config checked: ``--help`` and a config or
data-path error answer at once, before any process group, and leave no run folder behind."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmtrain.config import ConfigError, load_config
from mmtrain.config.help_text import section_help, sections_overview
from mmtrain.parallel.dims import LayoutError
from mmtrain.utils.cli import startup_error


def _launch_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun sets them; (0, 0, 1) for a plain ``python -m``. Read once, at
    start-up, to know who prints a start-up error (the process groups read them again in parallel/launch.py)."""
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), int(env.get("WORLD_SIZE", "1"))


def _startup_error(prog: str, message: str, rank: int, local_rank: int) -> int:
    """A config, layout or data-path error before any process group: printed once per node, exit code 2."""
    return startup_error(f"{prog}: config error: {message}", rank, local_rank)


def _parser(cls: type, prog: str, example: str) -> argparse.ArgumentParser:
    epilog = (f"config sections and their keys (each key's doc, default and range: --help-config SECTION; all of "
              f"them: docs/config-reference.md):\n{sections_overview(cls)}\n\nexamples:\n{example}")
    ap = argparse.ArgumentParser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog,
                                 description="Train from a YAML config; dotted key=value overrides win last "
                                             "(e.g. optim.lr=1e-4).")
    ap.add_argument("--config", default=None,
                    help="YAML file overlaying the defaults (may include: others); mmtrain:configs/... names the "
                         "configs that come with mmtrain, from any folder")
    ap.add_argument("--help-config", metavar="SECTION", default=None,
                    help="print SECTION's keys (e.g. optim, model.vision) with doc, default and range, and exit")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    return ap


def parse_run_config(cls: type, argv: list[str] | None, prog: str, example: str = "") -> Any:
    args = _parser(cls, prog, example).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.help_config is not None:
            print(section_help(cls, args.help_config))
            raise SystemExit(0)
        return load_config(cls, args.config, args.overrides)
    except ConfigError as exc:
        rank, local_rank, _ = _launch_env()
        raise SystemExit(_startup_error(prog, str(exc), rank, local_rank)) from None


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


def run_entry(prog: str, cls: type, validate: Callable[..., None], check_data: Callable[[Any], None],
              train: Callable[[], Callable[..., Any]], argv: list[str] | None, example: str = "") -> int:
    """One pretrain entry point: parse -> validate -> data paths -> processes and groups -> resolved config ->
    ``train()(cfg, mesh, device)``. ``check_data`` checks that the files the config names exist (before any
    process group and before the run folder is made); ``train`` returns the training function (imported only
    once the config is valid). Exit codes: 0 done, 2 a configuration/data/checkpoint error (one message, no
    traceback), 1 a collective timeout."""
    rank, local_rank, world_size = _launch_env()
    cfg = parse_run_config(cls, argv, prog, example)
    from mmtrain.data.blend_spec import BlendSpecError  # numpy, no torch

    try:
        validate(cfg, world_size=world_size)
        check_data(cfg)
        check_writable_run_dir(cfg.logging.run_dir)
    except (ConfigError, LayoutError, BlendSpecError) as exc:
        return _startup_error(prog, str(exc), rank, local_rank)
    return _run(prog, cfg, train, rank, local_rank)


def _run(prog: str, cfg: Any, train: Callable[[], Callable[..., Any]], env_rank: int, local_rank: int) -> int:
    from mmtrain.config import save_config
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.data.blend_spec import BlendSpecError
    from mmtrain.data.index_cache import IndexCacheTimeout
    from mmtrain.data.splits import SplitError
    from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed
    from mmtrain.train.checkpoint import CheckpointError
    from mmtrain.train.faults import CollectiveTimeout, NonFiniteError
    from mmtrain.utils.dcp_storage import CheckpointFormatError
    from mmtrain.utils.log import setup_logging

    try:
        device = pick_device(cfg.train.device)
    except RuntimeError as exc:  # train.device=cuda without a visible GPU
        return _startup_error(prog, str(exc), env_rank, local_rank)
    rank, world_size = init_distributed(cfg.parallel.backend, device, cfg.parallel.collective_timeout_s)
    log = setup_logging(rank)
    try:
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build(timeout_s=cfg.parallel.collective_timeout_s)
        if rank == 0:
            save_config(cfg, Path(cfg.logging.run_dir) / "config.yaml")
        log.info(f"layout: {mesh.dims.describe()} on {device}; resolved config in {cfg.logging.run_dir}/config.yaml")
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
