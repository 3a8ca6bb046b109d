"""GPT pre-training entry point: parse config -> validate -> processes and groups -> build -> train.

    torchrun --nproc_per_node N -m mmtrain.pretrain_gpt --config configs/gpt/F.yaml key=value ...
"""

from __future__ import annotations

from mmtrain.cli_args import run_entry
from mmtrain.config import GPTRunConfig, validate_gpt_config

EXAMPLE = """\
  python -m mmtrain.pretrain_gpt --config mmtrain:configs/gpt/tiny_cpu.yaml      # one process on the CPU
  torchrun --nproc_per_node 8 -m mmtrain.pretrain_gpt --config run.yaml parallel.tp=2 parallel.pp=2 \\
      train.device=cuda train.precision=bf16                                    # 8 GPUs: tp 2 x pp 2 x dp 2
  python -m mmtrain.pretrain_gpt --help-config parallel                         # the layout keys"""


def _check_data(cfg) -> None:
    from mmtrain.data.preflight import check_gpt_data_paths

    check_gpt_data_paths(cfg)
    if cfg.train.objective == "distill":  # the teacher's checkpoint, model and tokenizer, before any process group
        from mmtrain.train.distill_teacher import check_teacher

        check_teacher(cfg)


def _train_gpt():
    from mmtrain.train.loop import train_gpt

    return train_gpt


def main(argv: list[str] | None = None) -> int:
    return run_entry("mmtrain.pretrain_gpt", GPTRunConfig, validate_gpt_config, _check_data, _train_gpt, argv,
                     EXAMPLE)


if __name__ == "__main__":
    raise SystemExit(main())
