"""VLM pre-training entry point: parse config -> validate -> processes and groups -> build -> train.

    torchrun --nproc_per_node N -m mmtrain.pretrain_vlm --config configs/vlm/F.yaml key=value ...
"""

from __future__ import annotations

from mmtrain.cli_args import run_entry
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config

EXAMPLE = """\
  python -m mmtrain.pretrain_vlm --config mmtrain:configs/vlm/tiny_cpu.yaml data.blend=blend.yaml \\
      media.tokenizer=tok/sp.model                                              # one process on the CPU
  torchrun --nproc_per_node 8 -m mmtrain.pretrain_vlm --config mmtrain:configs/vlm/vlm_2b.yaml \\
      data.blend=blend.yaml media.tokenizer=tok/sp.model                        # 8 GPUs
  python -m mmtrain.pretrain_vlm --help-config model.vision                     # the ViT's keys"""


def _check_data(cfg) -> None:
    from mmtrain.data.preflight import check_vlm_data_paths

    check_vlm_data_paths(cfg)


def _train_vlm():
    from mmtrain.train.vlm_train import train_vlm

    return train_vlm


def main(argv: list[str] | None = None) -> int:
    return run_entry("mmtrain.pretrain_vlm", VLMRunConfig, validate_vlm_config, _check_data, _train_vlm, argv,
                     EXAMPLE)


if __name__ == "__main__":
    raise SystemExit(main())
