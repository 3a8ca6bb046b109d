"""The one-line step format, the metrics files, and the README's Quick start contract with CI."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from mmtrain.train.metrics import MetricsLogger, format_step_line

REPO = Path(__file__).resolve().parents[2]


def test_step_line_format():
    line = format_step_line(12, 100, {"loss": 3.21044, "lr": 3e-4, "grad_norm": 1.2345, "tokens_per_s": 12345.0,
                                      "tflops": 45.12, "mfu": 0.061, "mem_gib": 3.21, "step_time_s": 0.25})
    assert line == ("step 12/100 | loss 3.2104 | lr 3.00e-04 | grad_norm 1.2345 | tok/s 12.3k | tflops 45.1 | "
                    "mfu 6.1% | mem 3.2GiB | 250ms")


def test_metrics_logger_writes_jsonl_on_rank0_only(tmp_path, caplog):
    logger = MetricsLogger(tmp_path / "r0", rank=0, total_steps=2)
    logger.log_step(1, {"loss": 1.0})
    logger.close()
    assert json.loads((tmp_path / "r0" / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}
    other = MetricsLogger(tmp_path / "r1", rank=1, total_steps=2)
    other.log_step(1, {"loss": 1.0})
    other.close()
    assert not (tmp_path / "r1").exists()


def test_tensorboard_writer(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(tmp_path, rank=0, total_steps=1, tensorboard=True)
    logger.log_step(1, {"loss": 2.0})
    logger.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_second():
    helper = runpy.run_path(str(REPO / ".ci" / "readme_command.py"))
    commands = helper["quickstart_commands"]((REPO / "README.md").read_text())
    assert len(commands) == 2, commands
    assert "mmtrain.demo" in commands[0] and "pytest" in commands[1]
    printed = subprocess.run([sys.executable, str(REPO / ".ci" / "readme_command.py"), "2"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == commands[1]
    assert "readme_command.py 2" in (REPO / ".ci" / "run").read_text()


def test_console_log_goes_to_stdout_as_it_is_at_each_record(capsys):
    """Logging set up while stdout was redirected, then that stream closed: later records go to the stdout of
    their time, with no '--- Logging error ---' on stderr (it broke another test's reading of stderr)."""
    import contextlib
    import io

    from mmtrain.utils.log import get_logger, setup_logging

    earlier = io.StringIO()
    with contextlib.redirect_stdout(earlier):
        setup_logging(0)
        get_logger("train").info("first")
    earlier.close()
    get_logger("train").info("second")
    printed = capsys.readouterr()
    assert "second" in printed.out and "Logging error" not in printed.err
