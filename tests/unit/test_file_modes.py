"""Every file the project writes ends with the umask's mode (0o666 & ~umask), as a plain open() would give it,
not the 0o600 of the temporaries behind atomic writes: colleagues on a shared filesystem read these (issue #16).

One pass per umask runs the writers end to end (train-tokenizer, text prep, media prep, a short training run
over the prepared text with its index cache, config, metrics and checkpoints, an HF export) and then checks the
mode of every file and folder under the test's folder.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dataprep.cli import main as prep
from mmtrain.utils import atomic
from mmtrain.utils.atomic import atomic_open, atomic_write_bytes, atomic_write_text, current_umask, file_mode

UMASKS = [0o022, 0o077]


@pytest.fixture(params=UMASKS, ids=lambda m: f"umask{m:03o}")
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _wrong_modes(root: Path, mask: int) -> list[str]:
    """Every file under ``root`` whose permission bits are not 0o666 & ~mask (folders: 0o777 & ~mask)."""
    wrong = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        want = 0o777 & ~mask if stat.S_ISDIR(st.st_mode) else 0o666 & ~mask
        if stat.S_IMODE(st.st_mode) != want:
            wrong.append(f"{path.relative_to(root)}: {stat.S_IMODE(st.st_mode):o} (want {want:o})")
    return wrong


def test_umask_is_read_without_changing_it(umask, monkeypatch):
    assert current_umask() == umask and file_mode() == 0o666 & ~umask
    monkeypatch.setattr(atomic, "_umask_from_proc", lambda: None)  # no /proc: set-and-restore fallback
    assert current_umask() == umask and file_mode() == 0o666 & ~umask
    assert os.umask(umask) == umask  # the fallback put it back


def test_atomic_helpers_keep_the_umask_mode(umask, tmp_path):
    atomic_write_text(tmp_path / "a.txt", "a")
    atomic_write_bytes(tmp_path / "b.bin", b"b")
    with atomic_open(tmp_path / "sub" / "c.txt", "w") as f:
        f.write("c")
    (tmp_path / "d.txt").write_text("old")
    os.chmod(tmp_path / "d.txt", 0o600)
    atomic_write_text(tmp_path / "d.txt", "new")  # a rewrite gets the umask's mode too, like open("w") would not
    wrong = _wrong_modes(tmp_path, umask)
    assert not wrong, "\n".join(wrong)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "b.bin", "c.txt", "d.txt", "sub"]


def _train(rank: int, world_size: int, mask: int, run_dir: str, prefix: str) -> int:
    os.umask(mask)  # ranks fork from a server started before the test set the umask
    from mmtrain.pretrain_gpt import main

    return main(["--config", str(Path(__file__).resolve().parents[2] / "configs/gpt/tiny_cpu_mock.yaml"),
                 "data.mock=false", f"data.prefixes=[{prefix}]", "data.seq_length=16", "train.steps=2",
                 "train.micro_batch_size=2", "model.vocab_size=320", "checkpoint.save_every=1",
                 "checkpoint.keep_last=0", f"logging.run_dir={run_dir}"])


def test_every_output_gets_the_umask_mode(umask, tmp_path):
    from dataprep.samples_media import write_media_samples
    from mmtrain.convert import mmtrain_to_hf
    from mmtrain.testing import run_distributed

    corpus = tmp_path / "corpus.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(400):
            f.write(json.dumps({"text": " ".join(words[(i * j) % len(words)] for j in range(1, 30))}) + "\n")
        f.write("{not json\n")  # a reject: the rejects log is an output too
    assert prep(["train-tokenizer", "--input", str(corpus), "--output-prefix", str(tmp_path / "tok" / "sp"),
                 "--vocab-size", "300", "--threads", "1"]) == 0
    prefix = tmp_path / "text" / "corpus"
    assert prep(["text", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer",
                 str(tmp_path / "tok" / "sp.model"), "--append-eod", "--workers", "0", "--progress", "never"]) == 0
    assert Path(f"{prefix}.rejects.jsonl").is_file()

    manifest = write_media_samples(tmp_path / "media_in", num_images=4, num_audio=0, video=False)
    assert prep(["media", "--input", str(manifest), "--output", str(tmp_path / "media"), "--workers", "1",
                 "--no-progress"]) == 0

    run_dir = tmp_path / "run"
    assert run_distributed(_train, 1, umask, str(run_dir), str(prefix)) == [0]
    mmtrain_to_hf(run_dir / "checkpoints", tmp_path / "hf")

    produced = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    for expected in ("tok/sp.model", "tok/sp.manifest.json", "text/corpus.bin", "text/corpus.manifest.json",
                     "media/manifest.json", "media/.nv-meta/index.sqlite", "run/config.yaml", "run/metrics.jsonl",
                     "run/checkpoints/latest", "run/checkpoints/step_00000002/complete.json",
                     "hf/config.json", "hf/model.safetensors"):
        assert expected in produced, expected
    assert any(p.startswith("text/corpus.cache/") and p.endswith(".npy") for p in produced)
    wrong = _wrong_modes(tmp_path, umask)
    assert not wrong, "\n".join(wrong)
