"""python -m mmtrain.plot: PNGs of loss, validation loss, lr, tokens/s and MFU; bad metrics files are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from mmtrain.plot import main  # noqa: E402


def write_run(folder: Path, steps: int, scale: float = 1.0, mfu: bool = True) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            row = {"step": s, "loss": scale * 6 / s, "lr": 1e-3 * min(1, s / 5), "grad_norm": 1.0,
                   "tokens_per_s": 1000.0 + s, "step_time_s": 0.1, "moe": {"aux": 0.1}}
            if mfu:
                row["mfu"] = 0.3
            if s % 5 == 0:
                row["val_loss"] = scale * 7 / s
            f.write(json.dumps(row) + "\n")
    return folder


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_run_gives_five_pngs_in_its_folder(tmp_path, capsys):
    run = write_run(tmp_path / "a", 20)
    assert main([str(run)]) == 0
    pngs = sorted(p.name for p in (run / "plots").iterdir())
    assert pngs == ["loss.png", "lr.png", "mfu.png", "tokens_per_s.png", "val_loss.png"]
    assert all(is_png(run / "plots" / p) for p in pngs)
    assert "wrote 5 plot(s)" in capsys.readouterr().out


def test_several_runs_overlaid_and_missing_figures_said(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", 12), write_run(tmp_path / "b", 8, 2.0, mfu=False)
    assert main([str(a), str(b / "metrics.jsonl"), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "mfu.png").exists()  # one run has it
    c = write_run(tmp_path / "c", 3, mfu=False)
    assert main([str(c), "--out", str(tmp_path / "c_plots")]) == 0
    out = capsys.readouterr().out
    assert "no values for val_loss, mfu; MFU needs logging.peak_tflops" in out


@pytest.mark.parametrize("content, expect", [
    (None, "metrics.jsonl: not found"),
    ('{"step": 1, "loss": 2.0}\nnot json\n{"step": 3, "loss": 1.0}\n', "metrics.jsonl:2: not a metrics row"),
    ('{"loss": 2.0}\n', "metrics.jsonl:1: not a metrics row (no 'step' key)"),
    ('{"step": "x", "loss": 2.0}\n', "metrics.jsonl:1: not a metrics row (step is 'x'"),
    ('{"step": 1, "note": "x"}\n', "no metrics rows with loss"),
])
def test_bad_metrics_files_are_one_line_errors(tmp_path, capsys, content, expect):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0] and not (run / "plots").exists()


def test_a_last_line_cut_short_is_left_out_with_a_note(tmp_path, capsys):
    run = write_run(tmp_path / "r", 4)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    assert main([str(run)]) == 0
    assert "last line 5 cut short" in capsys.readouterr().err
