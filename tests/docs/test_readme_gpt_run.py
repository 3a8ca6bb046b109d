"""The README's one-process GPT command, as written, trains on the demo's shards: after the demo (README command 1)
it runs from the same folder and the loss falls (on mock tokens it stayed at ln 512)."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.docs.test_user_guide import guide_env

REPO = Path(__file__).resolve().parents[2]


def _readme_gpt_command() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Training a GPT\n+```shell\n(.*?)```", readme, re.S).group(1)
    line = block.splitlines()[0].split("#", 1)[0]
    return shlex.split(line)


def test_readme_one_process_command_learns_on_the_demo_shards(tmp_path):
    command = _readme_gpt_command()
    assert command[:3] == ["python", "-m", "mmtrain.pretrain_gpt"] and "configs/gpt/tiny_cpu.yaml" in command
    # the repository root as the README's user has it: configs/ there, the demo run in it (a smaller corpus)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = guide_env()
    demo = subprocess.run([sys.executable, "-m", "mmtrain.demo", "--no-vlm", "--steps", "1", "--docs", "300"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    proc = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "runs/tiny_cpu/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20
    assert abs(losses[0] - math.log(512)) < 0.3  # starts at chance
    assert losses[-1] < losses[0] - 1.0, losses  # and learns


def test_the_quickstart_config_names_missing_shards_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mmtrain.pretrain_gpt", "--config",
                           "mmtrain:configs/gpt/tiny_cpu.yaml"], cwd=tmp_path, env=guide_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"mmtrain.pretrain_gpt: config error: data.prefixes[0]: indexed dataset {tmp_path}/runs/demo/data/corpus not "
        f"found (missing {tmp_path}/runs/demo/data/corpus.idx, {tmp_path}/runs/demo/data/corpus.bin); give the prefix "
        "without .bin/.idx, relative to the folder the run starts in; make it with mmtrain-prep text"]
    assert list(tmp_path.iterdir()) == []  # no run folder
