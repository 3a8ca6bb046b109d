"""GPT pre-training entry point: parse config -> validate -> processes and groups -> build -> train.

    torchrun --nproc_per_node N -m mmtrain.pretrain_gpt --config configs/gpt/F.yaml key=value ...
"""

from __future__ import annotations

from mmtrain.cli_args import run_entry
from mmtrain.config import GPTRunConfig, validate_gpt_config


def _train_gpt():
    from mmtrain.train.loop import train_gpt

    return train_gpt


def main(argv: list[str] | None = None) -> int:
    return run_entry("mmtrain.pretrain_gpt", GPTRunConfig, validate_gpt_config, _train_gpt, argv)


if __name__ == "__main__":
    raise SystemExit(main())
