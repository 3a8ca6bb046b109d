"""Entry point: the DPO reference's log-probabilities of every preference pair, once, beside the shards.

    python -m mmtrain.dpo_reference --config dpo.yaml key=value ...     # the DPO run's config (any layout)

then train with ``dpo.reference_logps=precomputed`` (no reference model is built; docs/post-training.md).
"""

from __future__ import annotations

from mmtrain.cli_args import run_entry
from mmtrain.config import ConfigError, GPTRunConfig, validate_gpt_config

EXAMPLE = """\
  python -m mmtrain.dpo_reference --config dpo.yaml                         # writes PREFIX.dpo_reference.*
  torchrun --nproc_per_node 2 -m mmtrain.dpo_reference --config dpo.yaml parallel.tp=2 train.device=cuda"""


def _validate(cfg, world_size: int) -> None:
    validate_gpt_config(cfg, world_size=world_size)
    if cfg.train.objective != "dpo":
        raise ConfigError(f"train.objective={cfg.train.objective}: mmtrain.dpo_reference takes a DPO run's config "
                          "(train.objective=dpo, data.type=preference)")


def _check_data(cfg) -> None:
    from mmtrain.data.preflight import check_gpt_data_paths

    check_gpt_data_paths(cfg)


def _compute():
    from mmtrain.train.dpo_reference import compute_reference_logps

    return compute_reference_logps


def main(argv: list[str] | None = None) -> int:
    return run_entry("mmtrain.dpo_reference", GPTRunConfig, _validate, _check_data, _compute, argv,
                     EXAMPLE)


if __name__ == "__main__":
    raise SystemExit(main())
