"""train.sample_every: greedy samples at logging steps in the log and metrics.jsonl, from the weights of that
step (one process, TP2, and FSDP at DP2: the blocks gathered for the sampler, freed after); impossible settings are config errors naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import capture_log_messages, run_distributed
from tests.inference_helpers import tiny_tokenizer

BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
        "train.micro_batch_size=2", "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=4", "checkpoint.save_final=false", "logging.log_every=2",
        "train.sample_every=2", "train.sample_max_new_tokens=6"]


def _train(rank: int, world_size: int, run_dir: str, tok: str, extra: list[str]):
    from mmtrain.inference.engine import DecodeEngine, generate
    from mmtrain.inference.sampling import SamplingParams
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.train.loop import train_gpt

    messages = capture_log_messages()
    cfg = load_config(GPTRunConfig, None, [*BASE, f"logging.run_dir={run_dir}", f"train.sample_tokenizer={tok}",
                                           "train.sample_prompts=[Hello world, The quick brown]", *extra])
    validate_gpt_config(cfg, world_size)
    result = train_gpt(cfg, ParallelDims.from_config(cfg.parallel, world_size).build(), torch.device("cpu"))
    t = load_tokenizer(tok)
    final = generate(DecodeEngine(result.model, 2, 32), t.encode_batch(["Hello world", "The quick brown"]),
                     SamplingParams(6, stop_token_ids=(t.eod_id,)), decode=t.decode)
    return [m for m in messages if m.startswith("sample ")], [s.text for s in final]


@pytest.mark.parametrize("world, extra", [(1, []), (2, ["parallel.tp=2"]), (2, ["parallel.dp=2", "parallel.fsdp=true"])],
                         ids=["one", "tp2", "fsdp-dp2"])
def test_samples_are_logged_at_their_steps(tmp_path, world, extra):
    tok = str(tiny_tokenizer(tmp_path / "tok"))
    logged, final = run_distributed(_train, world, str(tmp_path / "run"), tok, extra)[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    with_samples = {r["step"]: r["samples"] for r in rows if "samples" in r}
    assert sorted(with_samples) == [2, 4]
    assert [s["prompt"] for s in with_samples[4]] == ["Hello world", "The quick brown"]
    assert [s["completion"] for s in with_samples[4]] == final  # the weights of the step it was taken at
    assert len(set(logged)) == 4 and logged[0].startswith("sample 0 at step 2: 'Hello world' -> ")


@pytest.mark.parametrize("extra, message", [
    (["train.sample_prompts=[]"], "train.sample_prompts is empty"),
    (["train.sample_every=3"], "multiple of logging.log_every"),
    (["parallel.pp=2", "parallel.tp=1"], "parallel.pp=1"),
    (["train.sample_tokenizer=/nonexistent/tok.json"], "train.sample_tokenizer=/nonexistent/tok.json"),
])
def test_sampling_config_errors_name_the_key(tmp_path, extra, message):
    tok = str(tiny_tokenizer(tmp_path / "tok"))
    cfg = load_config(GPTRunConfig, None, [*BASE, f"train.sample_tokenizer={tok}", "train.sample_prompts=[Hi]",
                                           *extra])
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_gpt_config(cfg, 2)
