"""A damaged, incomplete or mismatched checkpoint stops ``pretrain_gpt`` with exit 2 and one line on stderr
naming the file and what to do (no traceback); the checkpoint it names resumes. Deleting ``checksums.json``
does not turn the check off, and an edited ``complete.json`` is noticed (issue #29 item 7)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mmtrain.pretrain_gpt import main
from tests.cli_fork import ForkedMain

REPO = Path(__file__).resolve().parents[2]


def _pretrain(run_dir: Path, *overrides: str) -> ForkedMain:
    """``python -m mmtrain.pretrain_gpt`` in a process of its own (forked with torch imported: tests/cli_fork.py).
    Every run has train.steps=2 (a resume keeps the schedule): the first saves steps 1 and 2."""
    return ForkedMain(main, ["--config", str(REPO / "configs/gpt/tiny_cpu_mock.yaml"), f"logging.run_dir={run_dir}",
                             "train.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=0", *overrides],
                      env={"OMP_NUM_THREADS": "1"})


def _finish(proc: ForkedMain) -> tuple[int, str, str]:
    return proc.finish(timeout=240)


def test_damaged_missing_and_mismatched_checkpoints_are_one_line_errors(tmp_path):
    code, out, err = _finish(_pretrain(tmp_path / "run"))
    assert code == 0, out + err
    cases = ("flipped", "no_metadata", "no_checksums", "edited", "other_shape")
    for case in cases:
        shutil.copytree(tmp_path / "run", tmp_path / case)
    step2 = {case: tmp_path / case / "checkpoints" / "step_00000002" for case in cases}
    for case in ("flipped", "no_checksums"):
        data = step2[case] / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01  # one bit of one weight: DCP alone would resume with other values, exit 0
        data.write_bytes(bytes(raw))
    data = step2["flipped"] / "__0_0.distcp"
    (step2["no_metadata"] / ".metadata").unlink()
    (step2["no_checksums"] / "checksums.json").unlink()  # the record gone with the damage: still not exit 0
    meta = json.loads((step2["edited"] / "complete.json").read_text())
    meta["config"]["model"]["vocab_size"] = 1024
    (step2["edited"] / "complete.json").write_text(json.dumps(meta, indent=1))
    results = {}
    for pair in (("flipped", "no_metadata"), ("no_checksums", "edited")):  # two at a time: two cores
        procs = {case: _pretrain(tmp_path / case) for case in pair}
        results.update({case: _finish(p) for case, p in procs.items()})
    results["other_shape"] = _finish(_pretrain(tmp_path / "other_shape", "model.hidden_size=128"))
    for case, (code, out, err) in results.items():
        assert code == 2, (case, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (case, err)
    earlier = tmp_path / "flipped" / "checkpoints" / "step_00000001"
    assert results["flipped"][2].strip() == (
        f"mmtrain.pretrain_gpt: error: {data} does not match its checksum (corrupt?); the previous complete "
        f"checkpoint is {earlier} (checkpoint.load={earlier})")
    assert f"{step2['no_metadata'] / '.metadata'} is missing" in results["no_metadata"][2]
    assert "checkpoint.load=" in results["no_metadata"][2]
    for case, what in (("no_checksums", "checksums.json is missing, and complete.json says the checkpoint was "
                                        "written with checksums: its files cannot be checked"),
                       ("edited", "complete.json does not match its seal (changed after it was written?); if you "
                                  "edited it on purpose, seal it again: python -m mmtrain.convert rehash --ckpt "
                                  f"{step2['edited']}")):
        earlier = tmp_path / case / "checkpoints" / "step_00000001"
        assert results[case][2].strip() == (f"mmtrain.pretrain_gpt: error: {step2[case]}/{what}; the previous "
                                            f"complete checkpoint is {earlier} (checkpoint.load={earlier})"), case
    assert "'model.embed.weight' has shape (512, 64) in the checkpoint, (512, 128) here" in results["other_shape"][2]
    assert "resume with the model config it was saved with" in results["other_shape"][2]

    code, out, err = _finish(_pretrain(tmp_path / "flipped", f"checkpoint.load={earlier}"))
    assert code == 0, out + err
    assert "(step 1)" in out and "step 2/2" in out  # the named checkpoint resumes
