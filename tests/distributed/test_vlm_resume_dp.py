"""A VLM run on real (tiny) energon media shards mixed with text resumes at another data-parallel or context-
parallel size: the checkpoint holds the whole loader state, and the steps after the resume see the samples of an
uninterrupted run (their losses equal it). A damaged loader state stops the resume with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmtrain.config import load_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from tests.vlm_helpers import prep_text_and_media

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "tiny_cpu.yaml"
RUN = ["train.steps=4", "checkpoint.save_every=2", "train.micro_batch_size=1", "train.global_batch_size=2",
       "model.audio.enabled=false", "model.vision.num_layers=1", "model.language.num_layers=1", "data.seq_length=24",
       "media.slices=4", "media.shuffle_buffer_size=8", "optim.warmup_steps=1", "optim.lr=1e-2",
       "logging.log_every=100", "checkpoint.keep_last=0"]


def _prep(root: Path) -> list[str]:
    """Captioned images (energon shards) and a text corpus, prepared by the public commands; a blend of both with
    one text row in five (so ranks take different numbers of media rows per micro-batch)."""
    blend, tokenizer = prep_text_and_media(root, num_docs=30, num_images=16, num_audio=0, media_weight=4)
    return [f"data.blend={blend}", f"media.tokenizer={tokenizer}"]


def _train(world_size: int, run_dir: Path, extra: list[str]) -> list[float]:
    from mmtrain.train.vlm_train import train_vlm

    cfg = load_config(VLMRunConfig, CONFIG, [*RUN, f"logging.run_dir={run_dir}", *extra])
    validate_vlm_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    return train_vlm(cfg, mesh, torch.device("cpu")).losses


def _resume(rank: int, world_size: int, root: Path, source: str, name: str, extra: list[str]) -> list[float]:
    """Steps 3-4 in run ``name`` from run ``source``'s step-2 checkpoint."""
    import torch.distributed as dist

    run = root / name
    if rank == 0:
        shutil.copytree(root / source / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
        (run / "checkpoints" / "latest").write_text("step_00000002\n")
    if world_size > 1:
        dist.barrier()
    return _train(world_size, run, extra)


def _one_rank(rank: int, world_size: int, root: str, data: list[str], stage: str):
    root = Path(root)
    if stage == "first":  # the uninterrupted single-process run (its step-2 checkpoint is dp1's)
        return _train(1, root / "dp1", data)
    tail = _resume(rank, world_size, root, "dp2", "dp2_to_dp1", data)
    return tail, _refused_after_damage(root / "dp2_to_dp1", data)


def _two_ranks(rank: int, world_size: int, root: str, data: list[str]):
    root = Path(root)
    dp2 = _train(world_size, root / "dp2", data)
    dp1_to_dp2 = _resume(rank, world_size, root, "dp1", "dp1_to_dp2", data)
    dp2_to_cp2 = _resume(rank, world_size, root, "dp2", "dp2_to_cp2", [*data, "parallel.cp=2"])
    return dp2, dp1_to_dp2, dp2_to_cp2


def test_vlm_on_media_shards_resumes_at_another_dp_and_cp_size(tmp_path):
    data = _prep(tmp_path / "data")
    full = run_distributed(_one_rank, 1, str(tmp_path), data, "first")[0]
    dp2, dp1_to_dp2, dp2_to_cp2 = run_distributed(_two_ranks, 2, str(tmp_path), data)[0]
    dp2_to_dp1, refused = run_distributed(_one_rank, 1, str(tmp_path), data, "resume")[0]
    # the same samples per step at dp1 and dp2 (older versions dealt the rows of a text + media blend otherwise)
    assert len(full) == 4 and dp2 == pytest.approx(full, rel=1e-5)
    for name, tail in (("dp2->dp1", dp2_to_dp1), ("dp1->dp2", dp1_to_dp2), ("dp2->cp2", dp2_to_cp2)):
        assert tail == pytest.approx(full[2:], rel=1e-5), name
    # every rank file holds the whole loader state: every slice, the global media count
    state = json.loads((tmp_path / "dp2" / "checkpoints" / "step_00000002" / "rank_00001.json").read_text())
    energon = state["loader"]["energon"]
    assert sorted(energon["slices"]) == ["0", "1", "2", "3"]
    assert energon["consumed_micro_batches"] == 4 - 4 // 5  # 4 rows, one text row in five
    # an edited loader state: one line naming the checkpoint and the state's key
    folder, message = refused
    assert message.startswith(f"{folder}: cannot resume the data loader: ") and "slice '1'" in message, message
    assert "\n" not in message


def _refused_after_damage(run: Path, data: list[str]) -> tuple[str, str]:
    """Edit the run's latest loader state (JSON and checksum both rewritten, complete.json sealed again, so it
    passes the file check) and resume from it: the CheckpointError's text."""
    from mmtrain.train.checkpoint import CheckpointError
    from mmtrain.utils.checkpoint_marker import reseal_checkpoint
    from mmtrain.utils.file_checksums import entry_of_bytes

    folder = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    rank_file = folder / "rank_00000.json"
    state = json.loads(rank_file.read_text())
    state["loader"]["energon"]["slices"]["1"]["batches"] = "two"
    body = json.dumps(state).encode()
    rank_file.write_bytes(body)
    sums = json.loads((folder / "checksums.json").read_text())
    sums["files"][rank_file.name] = entry_of_bytes(body)
    (folder / "checksums.json").write_text(json.dumps(sums))
    reseal_checkpoint(folder)
    try:
        _train(1, run, data)
    except CheckpointError as exc:
        return str(folder), str(exc)
    return str(folder), "resumed"
