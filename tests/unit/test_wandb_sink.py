"""The Weights & Biases sink: the metrics.jsonl figures and the resolved config, rank 0 only, offline (no network)."""

from __future__ import annotations

import glob
import json
import struct
import sys
import types
from pathlib import Path

import pytest

from mmtrain.config.loader import ConfigError
from mmtrain.config.schema import GPTRunConfig, LoggingConfig
from mmtrain.train.metrics import MetricsLogger
from mmtrain.train.wandb_sink import RUN_ID_FILE, WandbSink, wandb_figures

REPO = Path(__file__).resolve().parents[2]


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, figures, step):
        self.logged.append((step, figures))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording what the sink hands it."""
    runs: list[_FakeRun] = []
    mod = types.ModuleType("wandb")
    mod.Settings = lambda **kw: kw

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs))
        return runs[-1]
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return runs


def test_figures_are_the_rows_numbers_nested_ones_flattened():
    row = {"loss": 2.5, "lr": 1e-3, "skipped": 1, "moe": {"aux": 0.1, "per_layer": [1, 2]}, "note": "x", "ok": True}
    assert wandb_figures(row) == {"loss": 2.5, "lr": 1e-3, "skipped": 1, "moe/aux": 0.1}


def test_sink_gets_every_row_and_the_config_and_keeps_its_run_id(tmp_path, fake_wandb):
    logging = LoggingConfig(run_dir=str(tmp_path / "myrun"), wandb=True, wandb_project="proj", wandb_tags=["a"],
                            wandb_mode="offline")
    config = {"logging": {"run_dir": logging.run_dir}, "train": {"steps": 3}}
    (tmp_path / "myrun").mkdir()
    sink = WandbSink(logging, logging.run_dir, config)
    metrics = MetricsLogger(logging.run_dir, rank=0, total_steps=3, log_every=2, sinks=[sink])
    rows = [{"loss": 3.0 - s, "lr": 0.01 * s, "step_time_s": 0.5} for s in range(1, 4)]
    for s, row in enumerate(rows, 1):
        metrics.log_step(s, row)
    metrics.close()
    run = fake_wandb[0]
    assert run.finished and run.logged == list(enumerate(rows, 1))  # every step, not only the printed ones
    assert run.init["config"] == config and run.init["project"] == "proj" and run.init["tags"] == ["a"]
    assert run.init["name"] == "myrun" and run.init["mode"] == "offline" and run.init["dir"] == logging.run_dir
    kept = (tmp_path / "myrun" / RUN_ID_FILE).read_text().strip()
    assert run.init["id"] == kept and run.init["resume"] == "allow"
    WandbSink(logging, logging.run_dir, config)  # a resumed run: the same W&B run
    assert fake_wandb[1].init["id"] == kept


def test_a_refused_start_is_one_config_error(tmp_path, fake_wandb):
    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)\nmore lines")
    sys.modules["wandb"].init = refuse
    with pytest.raises(ConfigError, match=r"^logging.wandb: W&B could not start the run \(RuntimeError: api_key not "
                                          r"configured \(no-tty\)\); run `wandb login`"):
        WandbSink(LoggingConfig(run_dir=str(tmp_path), wandb=True), tmp_path, {})


def test_other_ranks_never_log(tmp_path):
    class Sink:
        logged = 0

        def log(self, step, metrics):
            Sink.logged += 1

        def close(self):
            pass
    m = MetricsLogger(tmp_path, rank=1, total_steps=1, sinks=[Sink()])
    m.log_step(1, {"loss": 1.0})
    m.close()
    assert Sink.logged == 0


def test_missing_wandb_is_a_config_error_before_any_process_group(monkeypatch):
    import importlib.util

    from mmtrain.config.validate import validate_gpt_config

    cfg = GPTRunConfig()
    cfg.data.mock = True
    cfg.logging.wandb = True
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb=true needs the wandb package"):
        validate_gpt_config(cfg)


def _wandb_records(path: str):
    """The protobuf records of a .wandb file (LevelDB log blocks after a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left  # block padding
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _train_offline(rank: int, world_size: int, run_dir: str) -> int:
    from mmtrain.pretrain_gpt import main

    return main(["--config", str(REPO / "configs/gpt/tiny_cpu.yaml"), "data.mock=true", "data.seq_length=16",
                 "train.steps=3", "train.micro_batch_size=2", "model.vocab_size=320", "checkpoint.save_final=false",
                 f"logging.run_dir={run_dir}", "logging.wandb=true", "logging.wandb_mode=offline",
                 "logging.wandb_project=tiny", "logging.wandb_tags=[cpu,test]"])


@pytest.mark.slow  # wandb starts its service process (~10 s on an idle machine)
def test_offline_training_run_writes_the_metrics_and_config(tmp_path):
    pytest.importorskip("wandb")
    from mmtrain.testing import run_distributed

    run_dir = tmp_path / "run"
    # no network: offline mode never connects; WANDB_API_KEY unset, so nothing could log in either
    assert run_distributed(_train_offline, 1, str(run_dir), env={"WANDB_API_KEY": "", "WANDB_SILENT": "true"},
                           timeout_s=240) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history, run = [], None
    for r in _wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            step = items.get("_step", r.history.step.num)
            history.append({k: v for k, v in items.items() if not k.startswith("_")} | {"step": step})
        elif kind == "run":
            run = r.run
    assert [h["step"] for h in history] == [row["step"] for row in rows] == [1, 2, 3]
    for h, row in zip(history, rows):
        assert h.keys() == row.keys() and all(h[k] == pytest.approx(row[k]) for k in row)
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["steps"] == 3 and config["logging"]["wandb_project"] == "tiny"
    assert run.project == "tiny" and list(run.tags) == ["cpu", "test"] and run.display_name == "run"
