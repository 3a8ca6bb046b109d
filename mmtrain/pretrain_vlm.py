"""VLM pre-training entry point: parse config -> validate -> processes and groups -> build -> train.

    torchrun --nproc_per_node N -m mmtrain.pretrain_vlm --config configs/vlm/F.yaml key=value ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mmtrain.cli_args import parse_run_config
from mmtrain.config import ConfigError, save_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config
from mmtrain.parallel import LayoutError, ParallelDims, init_distributed, pick_device, shutdown_distributed
from mmtrain.utils.log import setup_logging


def main(argv: list[str] | None = None) -> int:
    cfg = parse_run_config(VLMRunConfig, argv, "mmtrain.pretrain_vlm")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_vlm_config(cfg, world_size=world_size)
    except (ConfigError, LayoutError) as exc:
        print(f"mmtrain.pretrain_vlm: config error: {exc}", file=sys.stderr)
        return 2
    device = pick_device(cfg.train.device)
    rank, world_size = init_distributed(cfg.parallel.backend, device, cfg.parallel.collective_timeout_s)
    log = setup_logging(rank)
    try:
        mesh = ParallelDims.from_config(cfg.parallel, world_size).build(timeout_s=cfg.parallel.collective_timeout_s)
        if rank == 0:
            save_config(cfg, Path(cfg.logging.run_dir) / "config.yaml")
        log.info(f"layout: {mesh.dims.describe()} on {device}; resolved config in {cfg.logging.run_dir}/config.yaml")
        from mmtrain.data.blend_spec import BlendSpecError
        from mmtrain.data.index_cache import IndexCacheTimeout
        from mmtrain.data.splits import SplitError
        from mmtrain.train.checkpoint import CheckpointError
        from mmtrain.train.faults import CollectiveTimeout, NonFiniteError
        from mmtrain.train.vlm_train import train_vlm

        try:
            train_vlm(cfg, mesh, device)
        except (CheckpointError, ConfigError, BlendSpecError, SplitError, IndexCacheTimeout, NonFiniteError) as exc:
            log.error(f"error: {exc}")
            return 2
        except CollectiveTimeout as exc:
            log.error(f"error: {exc}")
            return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
