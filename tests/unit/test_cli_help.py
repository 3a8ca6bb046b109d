"""First contact with the entry points: --help answers without importing torch and lists every config section
with its keys; --help-config SECTION prints a section's keys with doc, default and range; a wrong layout or a
missing data path is one line that says what to do, before anything is created."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmtrain.config import GPTRunConfig
from mmtrain.config.help_text import section_help, sections_overview
from mmtrain.config.vlm_run_schema import VLMRunConfig

REPO = Path(__file__).resolve().parents[2]
# runs the entry point's main() as `python -m` would, then reports which heavy modules it imported
_PROBE = ("import runpy, sys\nsys.argv = [sys.argv[1], *sys.argv[2:]]\ntry:\n    runpy.run_module(sys.argv[0], "
          "run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
          "print('HEAVY', sorted(m for m in ('torch', 'numpy', 'megatron.energon', 'lm_eval', 'transformers') "
          "if m in sys.modules), code)")


def _probe(module: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("module, cls", [("mmtrain.pretrain_gpt", GPTRunConfig),
                                         ("mmtrain.pretrain_vlm", VLMRunConfig)])
def test_help_imports_no_torch_and_lists_sections_keys_and_a_torchrun_example(module, cls):
    proc = _probe(module, "--help")
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY [] 0", proc.stdout[-500:] + proc.stderr
    out = proc.stdout
    for section in ("parallel", "data", "optim", "train", "logging", "checkpoint", "model"):
        assert f"\n  {section}: " in out
    assert "tp pp cp dp ep " in out and " sequence_parallel " in out and "lr min_lr weight_decay" in out
    assert "--help-config SECTION" in out and "torchrun --nproc_per_node 8 -m " + module in out
    assert sections_overview(cls) in out


@pytest.mark.parametrize("argv, shows", [
    (["mmtrain.evaluate", "--help"], "--max-samples"),
    (["mmtrain.convert", "--help"], "mmtrain-to-hf"),
    (["mmtrain.convert", "mmtrain-to-hf", "--help"], "--no-tokenizer"),
    (["mmtrain.lm_eval", "--help"], "--model_args of the mmtrain model"),
    (["mmtrain.quantize", "--help"], "--group-size"),
])
def test_help_of_the_tools_imports_nothing_heavy(argv, shows):
    """evaluate, convert and lm_eval answer --help as the pretrain entry points do: without torch (seconds of
    import), lm-eval or transformers; lm_eval's help is about the mmtrain model's arguments."""
    proc = _probe(*argv)
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY [] 0", proc.stdout[-500:] + proc.stderr
    assert shows in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["mmtrain.evaluate", "--ckpt", "nowhere", "--data", "shards/web"], "--ckpt nowhere: not found"),
    (["mmtrain.evaluate", "--ckpt", ".", "--data", "shards/web"],
     "--data shards/web: indexed dataset not found (missing shards/web.idx, shards/web.bin)"),
    (["mmtrain.convert", "mmtrain-to-hf", "--ckpt", "nowhere", "--out", "hf"], "--ckpt nowhere: not found"),
    (["mmtrain.convert", "hf-to-mmtrain", "--hf", "nowhere", "--out", "ckpt"], "--hf nowhere: not found"),
    (["mmtrain.quantize", "--ckpt", "nowhere", "--scheme", "fp8", "--out", "q"], "--ckpt nowhere: not found"),
    (["mmtrain.quantize", "--ckpt", ".", "--scheme", "w4a16", "--method", "gptq", "--calib", "shards/web",
      "--out", "q"], "--calib shards/web: not prepared data (missing shards/web.idx, shards/web.bin)"),
])
def test_a_missing_input_is_not_found_before_torch(tmp_path, argv, message):
    proc = _probe(*argv, cwd=tmp_path)
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY [] 2"


def test_lm_eval_names_a_missing_checkpoint_before_torch_and_task_indexing(tmp_path):
    pytest.importorskip("lm_eval")
    proc = _probe("mmtrain.lm_eval", "--model", "mmtrain", "--model_args", "ckpt=nowhere", "--tasks", "hellaswag",
                  cwd=tmp_path)
    assert f"python -m mmtrain.lm_eval: error: ckpt=nowhere: not found (looked for {tmp_path}/nowhere)" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert "torch" not in last and last.endswith(" 2"), last


def test_help_config_prints_keys_with_doc_default_and_range():
    text = section_help(GPTRunConfig, "optim")
    assert "optim.lr  (float, default 0.0003, range > 0)" in text
    assert "optim.schedule  ({cosine,wsd,constant}, default 'cosine')" in text
    vision = section_help(VLMRunConfig, "model.vision")
    assert "model.vision.patch_size  (int, default" in vision
    top = section_help(VLMRunConfig, "top")
    assert "freeze  (list[str], default [])" in top
    proc = _probe("mmtrain.pretrain_gpt", "--help-config", "parallel")
    assert "parallel.tp  (int, default 1, range >= 1)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY [] 0"


def test_help_config_of_an_unknown_section_names_the_sections():
    from mmtrain.config.family_sections import composed_families

    proc = _probe("mmtrain.pretrain_gpt", "--help-config", "optimizer")
    families = "".join(f"model.{name}, " for name in composed_families())  # the table's, not a list by hand
    assert proc.stderr.strip() == ("mmtrain.pretrain_gpt: config error: --help-config optimizer: no such config "
                                   "section; sections: parallel, data, optim, train, logging, checkpoint, model, "
                                   f"{families}fp8, peft, peft.lora, dpo, grpo, distill")
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY [] 2"


def test_wrong_layout_suggests_the_process_count_or_the_size(tmp_path):
    proc = _probe("mmtrain.pretrain_gpt", "--config", "mmtrain:configs/gpt/tiny_cpu_mock.yaml", "parallel.tp=2",
                  f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.stderr.strip() == (
        "mmtrain.pretrain_gpt: config error: world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2; start a "
        "multiple of 2 processes (torchrun --nproc_per_node 2, or that many over the nodes) or make tp*pp*cp "
        "divide 1 (e.g. parallel.tp=1)")
    assert "torch" not in proc.stdout and proc.stdout.strip().endswith(" 2")  # torch was never imported for it
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["data.blend=blends/mix.yaml"],
     "data.blend=blends/mix.yaml: blend spec not found (looked for {tmp}/blends/mix.yaml); paths are relative to "
     "the folder the run starts in"),
    (["data.prefixes=[shards/web]"],
     "data.prefixes[0]: indexed dataset {tmp}/shards/web not found (missing {tmp}/shards/web.idx, "
     "{tmp}/shards/web.bin)"),
])
def test_missing_gpt_data_is_named_before_any_process_group(tmp_path, overrides, message):
    proc = _probe("mmtrain.pretrain_gpt", "--config", "mmtrain:configs/gpt/tiny_cpu.yaml", *overrides,
                  f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert len(proc.stderr.strip().splitlines()) == 1 and message.format(tmp=tmp_path) in proc.stderr, proc.stderr
    assert "torch" not in proc.stdout.strip().splitlines()[-1] and proc.stdout.strip().endswith(" 2")
    assert not (tmp_path / "run").exists()


def test_missing_media_folder_is_named_before_any_process_group(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "blend.yaml").write_text("train:\n  - {path: nowhere, type: energon, weight: 1}\n")
    (tmp_path / "tok.model").write_text("")
    cases = [("data.blend=media", f"data.blend=media: {tmp_path}/media has no .nv-meta/ folder"),
             ("data.blend=shards/media", f"data.blend=shards/media: media folder or blend spec not found (looked "
                                         f"for {tmp_path}/shards/media)"),
             ("data.blend=blend.yaml", f"energon dataset folder {tmp_path}/nowhere not found")]
    for override, message in cases:
        proc = _probe("mmtrain.pretrain_vlm", "--config", "mmtrain:configs/vlm/tiny_cpu.yaml", override,
                      "media.tokenizer=tok.model", f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path)
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
        assert proc.stdout.strip().endswith(" 2") and not (tmp_path / "run").exists()


def test_a_config_path_outside_the_repository_points_at_the_bundled_one(tmp_path):
    proc = _probe("mmtrain.pretrain_gpt", "--config", "configs/gpt/tiny_cpu.yaml", cwd=tmp_path)
    assert proc.stderr.strip() == (f"mmtrain.pretrain_gpt: config error: config file not found: {tmp_path}/configs/"
                                   "gpt/tiny_cpu.yaml; the bundled one is mmtrain:configs/gpt/tiny_cpu.yaml (found "
                                   "from any folder)")


def test_cuda_device_without_a_gpu_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = _probe("mmtrain.pretrain_gpt", "--config", "mmtrain:configs/gpt/tiny_cpu_mock.yaml", "train.device=cuda",
                  f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.stderr.strip() == ("mmtrain.pretrain_gpt: config error: train.device=cuda but no CUDA device is "
                                   "visible; use train.device=cpu or auto")
    assert proc.stdout.strip().endswith(" 2")


@pytest.mark.parametrize("ckpt, name", [("runs/guide/checkpoints", "guide"),
                                        ("runs/guide/checkpoints/step_00000060", "guide"),
                                        ("converted/llama-1b", "llama-1b")])
def test_a_server_names_its_model_after_the_run_not_checkpoints(ckpt, name):
    """``mmtrain.serve``'s default model name (``--model-name``): the run's folder for a checkpoints root or step."""
    from mmtrain.utils.cli import checkpoint_display_name

    assert checkpoint_display_name(ckpt) == name
