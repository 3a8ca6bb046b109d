"""pretrain_vlm: the entry point on prepped images + text, DP2 equal to DP1, frozen components bit-identical,
per-component learning rates, bit-exact resume, and config errors that name the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mmtrain.config import ConfigError, load_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config
from mmtrain.parallel import ParallelDims
from mmtrain.pretrain_vlm import main as vlm_main
from mmtrain.testing import run_distributed
from tests.cli_fork import run_main
from tests.vlm_helpers import prep_text_and_media

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "tiny_cpu.yaml"
# synthetic image-caption rows, a smaller model than the demo's: fast on a loaded CPU
SMALL = ["data.mock=true", "data.seq_length=24", "train.micro_batch_size=2", "train.global_batch_size=4",
         "optim.warmup_steps=1", "optim.lr=1e-2", "model.audio.enabled=false",
         "model.vision.num_layers=1", "model.language.num_layers=1", "logging.log_every=100",
         "checkpoint.keep_last=0"]


def _cfg(run_dir, extra: list[str]) -> VLMRunConfig:
    return load_config(VLMRunConfig, CONFIG, [*SMALL, f"logging.run_dir={run_dir}", *extra])


def _train(rank: int, world_size: int, run_dir: str, extra: list[str]):
    from mmtrain.train.vlm_train import train_vlm

    cfg = _cfg(run_dir, extra)
    validate_vlm_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_vlm(cfg, mesh, torch.device("cpu"))
    groups = [(g.get("lr_scale", 1.0), g["lr"], len(g["params"])) for g in result.optimizer.param_groups]
    state = {k: v.clone() for k, v in result.model.state_dict().items()}
    return result.losses, state, groups


def _initial_state(extra: list[str]) -> dict[str, torch.Tensor]:
    from mmtrain.models.vlm import VLMModel

    cfg = _cfg("unused", extra)
    model = VLMModel(cfg.model)
    model.init_weights(cfg.train.seed)
    return model.state_dict()


def test_dp2_and_tp2_equal_dp1_with_frozen_vision_and_scaled_projector(tmp_path):
    extra = ["train.steps=3", "freeze=[vision]", "lr_scale={projector: 3.0}"]
    losses1, state1, groups1 = run_distributed(_train, 1, str(tmp_path / "dp1"), extra)[0]
    losses2, state2, _ = run_distributed(_train, 2, str(tmp_path / "dp2"), extra)[0]
    assert losses1 == pytest.approx(losses2, rel=1e-5)
    tp2 = run_distributed(_train, 2, str(tmp_path / "tp2"), [*extra, "parallel.tp=2",
                                                              "parallel.sequence_parallel=true"])[0][0]
    assert losses1 == pytest.approx(tp2, rel=1e-5)  # the loop under TP+SP (the model's TP plan is tested apart)
    for name in state1:
        torch.testing.assert_close(state1[name], state2[name], rtol=1e-5, atol=1e-6, msg=name)
    init = _initial_state(extra)
    vision = [n for n in init if n.startswith("vision.")]
    assert vision and all(torch.equal(state1[n], init[n]) for n in vision)  # frozen: bit-identical
    moved = [n for n in init if not n.startswith("vision.") and not torch.equal(state1[n], init[n])]
    assert any(n.startswith("projector.") for n in moved) and any(n.startswith("language.") for n in moved)
    # per-component groups: the scheduled lr of the last step times the group's scale; frozen vision has none
    from mmtrain.train.lr import lr_at

    lr = lr_at(3, 3, _cfg("unused", extra).optim)
    assert sorted({(s, lr_) for s, lr_, n in groups1 if n}) == [(1.0, lr), (3.0, 3.0 * lr)]
    n_trainable = sum(n for _, _, n in groups1)
    assert n_trainable == sum(1 for n in init if not n.startswith("vision."))


def _resume_scenario(rank: int, world_size: int, root: str):
    """In one process (fewer spawns): full run, resumed run, stage 2 by checkpoint.load (refused) and by
    init_from (accepted)."""
    from mmtrain.train.checkpoint import CheckpointError

    root = Path(root)
    extra = ["train.steps=4", "checkpoint.save_every=2"]
    full = _train(rank, world_size, str(root / "full"), extra)[0]
    resumed = root / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    shutil.copytree(root / "full" / "checkpoints" / "step_00000002", resumed / "step_00000002")
    (resumed / "latest").write_text("step_00000002\n")
    tail = _train(rank, world_size, str(root / "resumed"), extra)[0]
    stage2 = ["train.steps=1", "freeze=[vision]", "checkpoint.save_final=false"]
    try:
        _train(rank, world_size, str(root / "s2"), [*stage2, f"checkpoint.load={root / 'full/checkpoints'}",
                                                     "checkpoint.schedule_change=use_config",  # past that check
                                                     "checkpoint.data_order_change=use_config"])
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    first = _train(rank, world_size, str(root / "s2b"), [*stage2, f"init_from={root / 'full/checkpoints'}"])[0]
    return full, tail, refused, first


def test_resume_continues_bit_exact_and_stage2_starts_from_stage1_weights(tmp_path):
    full, tail, refused, first = run_distributed(_resume_scenario, 1, str(tmp_path))[0]
    assert tail == full[2:]
    # other trainable parameters: checkpoint.load refuses; init_from takes the weights and starts at step 0
    assert "its optimizer holds other parameters" in refused
    assert len(first) == 1 and first[0] < full[0] - 0.5


def _prep_tiny_data(root: Path) -> tuple[Path, Path]:
    """A handful of captioned images + a text corpus, prepared by the public commands (in-process)."""
    return prep_text_and_media(root, num_docs=60, num_images=24, num_audio=3, media_weight=3)


def test_entry_point_trains_on_prepped_images_audio_and_text(tmp_path):
    blend, tokenizer = _prep_tiny_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    argv = ["--config", str(CONFIG), "train.steps=12", f"logging.run_dir={run_dir}", f"data.blend={blend}",
            f"media.tokenizer={tokenizer}", "model.vision.num_layers=1", "model.language.num_layers=1",
            "train.micro_batch_size=4", "freeze=[audio]", "logging.log_every=4"]
    # python -m mmtrain.pretrain_vlm, forked with torch and the VLM loader imported (tests/cli_fork.py)
    proc = run_main(vlm_main, argv, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    assert all(r["images_per_s"] > 0 for r in rows)
    resolved = load_config(VLMRunConfig, run_dir / "config.yaml")
    assert resolved.freeze == ["audio"] and resolved.data.blend == str(blend)
    assert yaml.safe_load((run_dir / "data" / "blend.text.yaml").read_text())["train"][0]["weight"] == 1


@pytest.mark.parametrize("override, message", [
    ("freez=[vision]", "did you mean 'freeze'"),
    ("freeze=[encoder]", "freeze[0]: 'encoder' is not a VLM component"),
    ("lr_scale={vision: 0}", "lr_scale.vision must be > 0, got 0.0"),
    ("freeze=[vision, audio, projector, language]", "freezes every component"),
    ("data.mm_num_image_tokens=16", "'data.mm_num_image_tokens' in command-line override "
                                    "'data.mm_num_image_tokens=16': the media path reads model.tokens_per_image"),
    ("data.mm_tokenizer=t.model", "it is now media.tokenizer"),
    ("data.seq_length=4", "the model's 4 placeholder tokens per image"),
    ("media.max_audio_seconds=40", "media.max_audio_seconds (40.0) gives clips of 2000 encoder positions, more than "
                                   "model.audio.max_frames (1500)"),
    ("model.language.num_attention_heads=3", "model.language.hidden_size (64) must be divisible by"),
    ("data.prefixes=[x]", "data.prefixes is for GPT runs"),
    ("parallel.virtual_pp=2", "virtual_pp"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        validate_vlm_config(load_config(VLMRunConfig, CONFIG, ["data.mock=true", override]), world_size=1)
    assert message in str(err.value)


def test_bad_config_on_the_command_line_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "mmtrain.pretrain_vlm", "--config", str(CONFIG), "data.mock=true",
                           "lr_scale={vision: 2}", "freeze=[vision]"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "lr_scale.vision names a frozen component" in proc.stderr
    assert "Traceback" not in proc.stderr



def _resume_other_layout(rank: int, world_size: int, root: str, layout: list[str]):
    import torch.distributed as dist

    run = Path(root) / ("_".join(layout) or "dp2")
    if rank == 0:  # the tp1/pp1/dp1 run's checkpoint at step 2, as this run's own
        shutil.copytree(Path(root) / "full" / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
        (run / "checkpoints" / "latest").write_text("step_00000002\n")
    dist.barrier()
    return _train(rank, world_size, str(run), [*RESUME, *layout])[0]


RESUME = ["train.steps=4", "checkpoint.save_every=2", "model.language.num_layers=2"]


def test_full_resume_at_another_tp_pp_dp_layout(tmp_path):
    """Weights, optimizer and loader state saved at tp1/pp1/dp1 continue at tp2, pp2 and dp2: the losses of steps
    3-4 are the uninterrupted run's."""
    full = run_distributed(_train, 1, str(tmp_path / "full"), RESUME)[0][0]
    for layout in (["parallel.tp=2"], ["parallel.pp=2"], []):
        tail = run_distributed(_resume_other_layout, 2, str(tmp_path), layout)[-1]
        assert tail == pytest.approx(full[2:], rel=1e-5), layout
