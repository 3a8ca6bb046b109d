"""The user guide's stop-and-resume (steps 6 and 8) equals one uninterrupted run; a resume keeps one metrics row
per step; a changed schedule is refused unless overridden, and the override does what it says."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from mmtrain.testing import DistributedTestFailure, run_distributed
from tests.data_helpers import write_text_dataset

REPO = Path(__file__).resolve().parents[2]


def _train(rank: int, world_size: int, config: str | None, overrides: list[str]):
    from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, config, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_gpt(cfg, mesh, torch.device("cpu")).losses


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same(row: dict) -> tuple:
    """What must be equal between two runs of the same steps (not the timings)."""
    return row["step"], row["loss"], row["lr"], row["grad_norm"], row.get("val_loss")


def _guide_blocks() -> tuple[str, str, list[str], list[str]]:
    """blend.yaml, run.yaml and the launch (step 6) and resume (step 8) commands, as the guide writes them."""
    text = (REPO / "docs" / "user-guide.md").read_text()

    def block(section: str, lang: str) -> str:
        return re.search(rf"## {section}\b.*?```{lang}\n(.*?)```", text, re.S).group(1)

    return block("4", "yaml"), block("5", "yaml"), shlex.split(block("6", "shell")), shlex.split(block("8", "shell"))


def _overrides(command: list[str]) -> tuple[int, list[str]]:
    """(processes, key=value overrides) of a guide command ``torchrun --nproc_per_node N -m ... --config run.yaml ...``."""
    assert command[:2] == ["torchrun", "--nproc_per_node"] and "mmtrain.pretrain_gpt" in command, command
    return int(command[2]), command[command.index("--config") + 2:]


def test_user_guide_stop_and_resume_equals_one_uninterrupted_run(tmp_path):
    blend_yaml, run_yaml, launch, resume = _guide_blocks()
    write_text_dataset(tmp_path / "shards" / "web", num_docs=1500, seed=1)
    write_text_dataset(tmp_path / "shards" / "code", num_docs=600, seed=2)
    (tmp_path / "blend.yaml").write_text(blend_yaml)
    run_yaml = run_yaml.replace("/path/to/mmtrain/", f"{REPO}/").replace("blend.yaml", str(tmp_path / "blend.yaml"))
    (tmp_path / "run.yaml").write_text(run_yaml)
    (n, stop), (n_again, again) = _overrides(launch), _overrides(resume)
    assert n == n_again == 2 and stop == ["train.exit_at_step=40"] and again == []
    config = str(tmp_path / "run.yaml")
    here = lambda d: [f"logging.run_dir={tmp_path / d}", f"data.cache_dir={tmp_path / 'cache'}"]  # noqa: E731

    run_distributed(_train, n, config, [*here("once")])  # one uninterrupted run of run.yaml
    first = run_distributed(_train, n, config, [*stop, *here("guide")])[0]  # step 6
    assert len(first) == 40 and (tmp_path / "guide/checkpoints/latest").read_text().strip() == "step_00000040"
    run_distributed(_train, n, config, [*again, *here("guide")])  # step 8

    once, guide = _rows(tmp_path / "once"), _rows(tmp_path / "guide")
    assert [r["step"] for r in guide] == list(range(1, 61))  # one row per step
    assert [_same(r) for r in guide] == [_same(r) for r in once]  # bit for bit, evaluations included
    assert [s for s, *_, val in map(_same, guide) if val is not None] == [20, 40, 60]


BASE = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=6",
        "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=2", "optim.lr=1e-2",
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=64",
        "checkpoint.save_every=3", "checkpoint.keep_last=0", "parallel.dp=2"]


def test_a_resume_replaces_the_rows_of_the_steps_it_runs_again(tmp_path):
    run_distributed(_train, 2, None, [*BASE, f"logging.run_dir={tmp_path / 'full'}"])
    # a run killed after logging step 6 (and half of a row of step 7) whose last checkpoint is step 3
    shutil.copytree(tmp_path / "full", tmp_path / "killed")
    shutil.rmtree(tmp_path / "killed/checkpoints/step_00000006")
    (tmp_path / "killed/checkpoints/latest").write_text("step_00000003\n")
    with open(tmp_path / "killed/metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    tail = run_distributed(_train, 2, None, [*BASE, f"logging.run_dir={tmp_path / 'killed'}"])[0]
    assert len(tail) == 3
    rows = _rows(tmp_path / "killed")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [_same(r) for r in rows] == [_same(r) for r in _rows(tmp_path / "full")]


def test_a_changed_schedule_is_refused_and_the_overrides_work(tmp_path):
    from mmtrain.config import OptimConfig
    from mmtrain.train.lr import lr_at

    def run(d, *extra):
        return run_distributed(_train, 2, None, [*BASE, f"logging.run_dir={tmp_path / d}", *extra])[0]

    run("a", "train.exit_at_step=3")
    for d in ("b", "c"):
        shutil.copytree(tmp_path / "a", tmp_path / d)
    with pytest.raises(DistributedTestFailure, match=re.escape("train.steps: 6 in the checkpoint, 8 now")):
        run("a", "train.steps=8")
    assert len(run("b", "train.steps=8", "checkpoint.schedule_change=use_checkpoint")) == 5
    assert len(run("c", "train.steps=8", "checkpoint.schedule_change=use_config")) == 5
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    for d, total in (("b", 6), ("c", 8)):
        rows = _rows(tmp_path / d)
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert [r["lr"] for r in rows[3:]] == [lr_at(s, total, optim) for s in range(4, 9)], d
    # the checkpoints of the run that kept its schedule record that schedule: resuming it needs no override again
    meta = json.loads((tmp_path / "b/checkpoints/step_00000006/complete.json").read_text())
    assert meta["schedule"]["train.steps"] == 6 and meta["config"]["train"]["steps"] == 8
