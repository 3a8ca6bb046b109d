"""parallel.fsdp: the combinations not supported yet are config errors naming the key (no process group)."""

from __future__ import annotations

import pytest

from mmtrain.config import ConfigError, GPTRunConfig, VLMRunConfig, load_config, validate_gpt_config
from mmtrain.config.vlm_validate import validate_vlm_config

GPT = ["data.mock=true", "parallel.fsdp=true", "parallel.dp=2"]


@pytest.mark.parametrize("extra", [[], ["train.compile=true"]], ids=["plain", "compile"])
def test_fsdp_is_accepted_with_the_distributed_optimizer(extra):
    validate_gpt_config(load_config(GPTRunConfig, None, [*GPT, *extra]), world_size=2)


@pytest.mark.parametrize("extra, message", [
    (["parallel.distributed_optimizer=false"], "parallel.fsdp=true shards the distributed optimizer's buckets; set "
                                               "parallel.distributed_optimizer=true"),
    (["train.precision=fp8", "train.device=cuda"], "parallel.fsdp=true with train.precision=fp8 is not supported yet"),
])
def test_fsdp_refuses_what_it_does_not_support(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_gpt_config(load_config(GPTRunConfig, None, [*GPT, *extra]), world_size=2)


def test_fsdp_refused_for_the_vlm():
    cfg = load_config(VLMRunConfig, None, ["data.mock=true", "parallel.fsdp=true"])
    with pytest.raises(ConfigError, match="parallel.fsdp=true is not supported for the VLM"):
        validate_vlm_config(cfg)
