"""GRPO on the CPU: a tiny model's mean reward rises on a toy task within 30 steps; num_iterations reuses the
completions it generated (with the reference's KL, a temperature and LoRA); a reward function that raises or returns
a non-number gives that completion reward 0 and is counted, never a crash; a broken prompts file, a bad config
or a checkpoint of another tokenizer is one line naming the file / line / key. The loss against TRL's is
tests/unit/test_grpo_loss.py; TP2 against one process tests/distributed/test_grpo_tp.py."""

from __future__ import annotations

import numpy as np
import pytest

from mmtrain.config import ConfigError, GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.data.blend_spec import BlendSpecError
from mmtrain.data.grpo_prompts import PromptFileError, read_prompts
from mmtrain.testing import run_distributed
from mmtrain.train.grpo_reward import RewardScorer, load_reward
from tests.grpo_helpers import grpo_overrides, metrics_rows, misbehaving, train_rank
from tests.inference_helpers import tiny_tokenizer


def test_mean_reward_rises_on_a_toy_task(tmp_path):
    run_distributed(train_rank, 1, grpo_overrides(tmp_path, "train.steps=30"))
    rows = metrics_rows(tmp_path / "run")
    rewards = [r["reward"] for r in rows]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert len(rows) == 30 and last > 2 * first and last > first + 0.08, rewards
    assert all(r["reward_errors"] == 0 and r["rollout_errors"] == 0 for r in rows)
    assert all(r["generation_s"] > 0 and r["rollouts_per_s"] > 0 and r["clip_ratio"] == 0 for r in rows)
    assert all(0 < r["completion_length"] <= 8 for r in rows) and "kl" not in rows[0]  # beta 0: no reference


def test_num_iterations_reuse_the_completions_against_their_sampling_log_probs(tmp_path):
    # with LoRA: the rollouts decode the adapted model, the reference is the base without adapters
    run_distributed(train_rank, 1, grpo_overrides(tmp_path, "train.steps=4", "grpo.num_iterations=2",
                                                  "grpo.beta=0.1", "grpo.temperature=0.7", "optim.lr=0.05",
                                                  "peft.lora.rank=8", "peft.lora.alpha=16"))
    rows = metrics_rows(tmp_path / "run")
    assert [r["generation_s"] > 0 for r in rows] == [True, False, True, False]
    assert rows[1]["reward"] == rows[0]["reward"] and rows[3]["reward"] == rows[2]["reward"]  # the same ones
    assert rows[0]["kl"] == 0 and rows[0]["clip_ratio"] == 0  # the policy is the reference and pi_old at step 1
    assert rows[1]["kl"] > 0 and rows[1]["clip_ratio"] > 0  # one update later: ratios move, some are clipped


def test_a_resumed_run_continues_as_one_uninterrupted_run(tmp_path):
    # the completions are seeded by the prompt's place in the run, so the resumed steps sample what the
    # uninterrupted run sampled (with the same restored weights)
    common = ["train.steps=4", "optim.lr=0.05"]
    straight = run_distributed(train_rank, 1, grpo_overrides(tmp_path / "a", *common))[0]
    run_distributed(train_rank, 1, grpo_overrides(tmp_path / "b", *common, "train.exit_at_step=2"))
    resumed = run_distributed(train_rank, 1, grpo_overrides(tmp_path / "b", *common))[0]
    np.testing.assert_allclose(resumed[0], straight[0][2:], rtol=1e-6, atol=1e-9)
    a, b = metrics_rows(tmp_path / "a" / "run"), metrics_rows(tmp_path / "b" / "run")
    assert [r["reward"] for r in b] == [r["reward"] for r in a] and len(b) == 4


def test_a_failing_reward_scores_zero_and_is_counted(tmp_path):
    prompts = [{"prompt": f"Say {kind}", "kind": kind} for kind in ("raise", "str", "nan", "none")]
    prompts += [{"prompt": f"Say fine {i}", "kind": "ok"} for i in range(4)]
    run_distributed(train_rank, 1, grpo_overrides(tmp_path, "train.steps=2", "train.micro_batch_size=8",
                                                  prompts=prompts, reward="tests.grpo_helpers:misbehaving"))
    rows = metrics_rows(tmp_path / "run")
    assert [r["reward_errors"] for r in rows] == [32, 32]  # 4 failing prompts x 8 completions, every step
    assert [r["reward"] for r in rows] == [0.5, 0.5]  # the 32 good ones score 1, the failed ones 0


def test_reward_scorer_values_and_errors():
    scorer = RewardScorer(misbehaving, "tests.grpo_helpers:misbehaving", "p.jsonl")
    assert scorer.score("p", "c", {"kind": "ok"}, 1) == (1.0, False)
    for kind in ("raise", "str", "nan", "none"):
        assert scorer.score("p", "c", {"kind": kind}, 2) == (0.0, True)
    assert scorer.score("p", "c", {}, 3) == (0.0, True)  # a missing field: the call raises TypeError
    assert scorer.errors == 5
    for value in (True, np.float32(0.5), 3):
        assert RewardScorer(lambda **kw: value, "x:y", "p").score("p", "c", {}, 1) == (float(value), False)


def test_load_reward_names_what_failed():
    assert load_reward("mmtrain.rewards:arithmetic_exact_match")(prompt="2 + 2 =", completion=" 4.", answer="4") == 1
    with pytest.raises(ConfigError, match=r"grpo.reward=no_such_module:f: cannot import no_such_module"):
        load_reward("no_such_module:f")
    with pytest.raises(ConfigError, match="mmtrain.rewards has no function nope"):
        load_reward("mmtrain.rewards:nope")


def test_the_example_rewards():
    from mmtrain.rewards import arithmetic_exact_match, regex_format

    assert arithmetic_exact_match("3 + 4 =", " 7 and more", answer="7") == 1.0
    assert arithmetic_exact_match("3 + 4 =", " 8", answer=7) == 0.0
    assert arithmetic_exact_match("3 + 4 =", " seven", answer="7") == 0.0
    assert regex_format("q", " <answer>12</answer>\n", pattern=r"<answer>\d+</answer>") == 1.0
    assert regex_format("q", "<answer>12</answer> extra", pattern=r"<answer>\d+</answer>") == 0.0


@pytest.mark.parametrize("line, message", [
    (b"{not json}", r"p.jsonl line 2: not JSON \(Expecting property name"),
    (b"\xff\xfe{}", r"p.jsonl line 2: not UTF-8"),
    (b"[1, 2]", r"p.jsonl line 2: a JSON list, not an object"),
    (b'{"text": "no prompt"}', r"p.jsonl line 2: needs a non-empty \"prompt\" string \(got NoneType\)"),
    (b'{"prompt": ""}', r"p.jsonl line 2: needs a non-empty \"prompt\" string"),
    (b'{"prompt": "x", "completion": "y"}', r"p.jsonl line 2: the field 'completion' cannot be passed"),
    (b'{"prompt": "x", "my-field": 1}', r"p.jsonl line 2: the field 'my-field' cannot be passed"),
    (b'{"prompt": "' + b"word " * 40 + b'"}', r"p.jsonl line 2: the prompt has \d+ tokens; .* at most 20"),
])
def test_a_broken_prompts_file_names_file_and_line(tmp_path, line, message):
    tok = load_tokenizer(tiny_tokenizer(tmp_path / "tok", chat_template=False))
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine", "answer": "1"}\n' + line + b"\n\n")
    with pytest.raises(PromptFileError, match=message):
        read_prompts(path, tok, 20)
    path.write_bytes(b'{"prompt": "fine", "answer": "1"}\n\n')  # blank lines are allowed
    (prompt,) = read_prompts(path, tok, 20)
    assert prompt.text == "fine" and prompt.fields == {"answer": "1"} and prompt.line == 1 and prompt.ids
    path.write_bytes(b"\n")
    with pytest.raises(PromptFileError, match="p.jsonl holds no prompt"):
        read_prompts(path, tok, 20)
    # a data error: the entry points print it as one line (exit 2), as a broken blend spec
    assert issubclass(PromptFileError, BlendSpecError)


@pytest.mark.parametrize("extra, message", [
    (["grpo.prompts="], "train.objective=grpo needs grpo.prompts"),
    (["grpo.tokenizer=missing.json"], r"grpo.tokenizer=missing.json: no such file"),
    (["grpo.reward=just_a_name"], "name the reward function as package.module:function"),
    (["data.mock=true"], "data.mock is not read by train.objective=grpo"),
    (["grpo.max_new_tokens=32"], r"grpo.max_new_tokens \(32\) must be below data.seq_length \(32\)"),
    (["grpo.reference=somewhere"], "grpo.reference is read only with grpo.beta > 0"),
    (["train.eval_every=5"], "train.eval_every is not supported with train.objective=grpo"),
    (["parallel.pp=2"], "train.objective=grpo does not support parallel.pp > 1"),
    (["grpo.group_size=1"], "grpo.group_size must be >= 2"),
    (["grpo.loss_type=cispo"], "grpo.loss_type"),
])
def test_config_errors_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_gpt_config(load_config(GPTRunConfig, None, grpo_overrides(tmp_path, *extra)), world_size=2)


def test_a_checkpoint_of_another_tokenizer_is_refused(tmp_path):
    from mmtrain.convert.checkpoint_io import write_weights_checkpoint
    from mmtrain.train.grpo import check_start_tokenizer
    from tests.inference_helpers import metaspace_tokenizer, tiny_config, tiny_model

    ours = load_tokenizer(tiny_tokenizer(tmp_path / "ours", chat_template=False))
    other = load_tokenizer(metaspace_tokenizer(tmp_path / "other"))
    cfg = tiny_config()
    state = tiny_model(cfg).state_dict()
    write_weights_checkpoint(tmp_path / "same", state, cfg, extra_meta={"tokenizer": ours.describe()})
    write_weights_checkpoint(tmp_path / "diff", state, cfg, extra_meta={"tokenizer": other.describe()})
    check_start_tokenizer(tmp_path / "same", ours)
    check_start_tokenizer(None, ours)
    with pytest.raises(ConfigError, match=r"grpo.tokenizer=.*ours/tokenizer.json is not the tokenizer of the model"):
        check_start_tokenizer(tmp_path / "diff", ours)
