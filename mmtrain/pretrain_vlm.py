"""VLM pre-training entry point: parse config -> validate -> processes and groups -> build -> train.

    torchrun --nproc_per_node N -m mmtrain.pretrain_vlm --config configs/vlm/F.yaml key=value ...
"""

from __future__ import annotations

from mmtrain.cli_args import run_entry
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config


def _train_vlm():
    from mmtrain.train.vlm_train import train_vlm

    return train_vlm


def main(argv: list[str] | None = None) -> int:
    return run_entry("mmtrain.pretrain_vlm", VLMRunConfig, validate_vlm_config, _train_vlm, argv)


if __name__ == "__main__":
    raise SystemExit(main())
