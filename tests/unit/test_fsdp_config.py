"""parallel.fsdp: the combinations it does not support are config errors naming the key (no process group)."""

from __future__ import annotations

import re

import pytest

from mmtrain.config import ConfigError, GPTRunConfig, VLMRunConfig, load_config, validate_gpt_config
from mmtrain.config.vlm_validate import validate_vlm_config

GPT = ["data.mock=true", "parallel.fsdp=true", "parallel.dp=2"]
FP8 = ["train.precision=fp8", "train.device=cuda"]


@pytest.mark.parametrize("extra", [[], ["train.compile=true"], [*FP8, "fp8.recipe=delayed"]],
                         ids=["plain", "compile", "fp8"])
def test_fsdp_is_accepted_with_the_distributed_optimizer(extra):
    validate_gpt_config(load_config(GPTRunConfig, None, [*GPT, *extra]), world_size=2)


@pytest.mark.parametrize("extra, message", [
    (["parallel.distributed_optimizer=false"], "parallel.fsdp=true shards the distributed optimizer's buckets; set "
                                               "parallel.distributed_optimizer=true"),
    ([*FP8, "fp8.backend=te"], "parallel.fsdp=true with train.precision=fp8 needs fp8.backend=native or auto"),
    ([*FP8, "fp8.recipe=rowwise", "fp8.format=e4m3"], "fp8.recipe must be tensorwise or delayed (got rowwise)"),
    ([*FP8, "model.hidden_size=4096", "model.num_attention_heads=32", "model.ffn_hidden_size=1000"],
     "needs every FP8 weight dimension a multiple of 16: model.ffn_hidden_size / parallel.tp is 1000"),
])
def test_fsdp_refuses_what_it_does_not_support(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_gpt_config(load_config(GPTRunConfig, None, [*GPT, *extra]), world_size=2)


def test_fsdp_refused_for_the_vlm():
    cfg = load_config(VLMRunConfig, None, ["data.mock=true", "parallel.fsdp=true"])
    with pytest.raises(ConfigError, match="parallel.fsdp=true is not supported for the VLM"):
        validate_vlm_config(cfg)
