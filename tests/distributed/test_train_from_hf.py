"""A Hugging Face model converted at PP=2 starts a TP=2 run with HF's logits; restarting resumes the run."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

transformers = pytest.importorskip("transformers")


def _logits_after_load(rank: int, world_size: int, ckpt: str, run_dir: str, steps: int, ids: torch.Tensor,
                       exit_at: int = 0):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", f"train.steps={steps}",
        f"train.exit_at_step={exit_at}",
        "train.micro_batch_size=1", "parallel.tp=2", f"checkpoint.load={ckpt}", f"logging.run_dir={run_dir}"])
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids), result.losses


def test_converted_weights_start_a_tp2_run(tmp_path):
    from mmtrain.convert.convert import hf_to_mmtrain

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "hf")
    hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt", tp=1, pp=2)
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        expected = hf(ids).logits
    logits, _ = run_distributed(_logits_after_load, 2, str(tmp_path / "ckpt"), str(tmp_path / "run"), 0, ids)[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    # train 2 of 3 steps (stopping with a checkpoint), then a restart with the same config resumes the run, not
    # the converted weights
    _, losses = run_distributed(_logits_after_load, 2, str(tmp_path / "ckpt"), str(tmp_path / "run"), 3, ids, 2)[0]
    assert len(losses) == 2
    _, more = run_distributed(_logits_after_load, 2, str(tmp_path / "ckpt"), str(tmp_path / "run"), 3, ids)[0]
    assert len(more) == 1  # resumed at step 2
