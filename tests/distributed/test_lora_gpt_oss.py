"""LoRA on the GPT-OSS family (``qkv``, ``proj``): GptOssForCausalLM -> hf-to-mmtrain -> a LoRA run -> the
merged export loads in transformers with the adapted model's logits, and the adapter export (``--lora adapter``)
on the HF base gives them through ``peft``'s PeftModel. (The layouts of a LoRA run: test_gpt_oss_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
             max_position_embeddings=256)


def _lora_from_hf(rank: int, world_size: int, ckpt: str, run_dir: str, ids: torch.Tensor, dora: bool):
    cfg = load_config(GPTRunConfig, f"{ckpt}/model.yaml", [
        "data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=2",
        "train.micro_batch_size=2", "optim.warmup_steps=0", "optim.lr=2e-2", "train.eval_every=0",
        "peft.lora.rank=4", "peft.lora.alpha=16", f"peft.lora.dora={str(dora).lower()}", f"checkpoint.load={ckpt}",
        f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    with torch.no_grad():
        return result.model.eval()(ids)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_from_hf_exports_merged_and_peft_adapter(tmp_path, dora):
    from mmtrain.convert.__main__ import main as convert

    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SMALL)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))  # 12 > the window of 4
    adapted = run_distributed(_lora_from_hf, 1, str(tmp_path / "base"), str(tmp_path / "run"), ids, dora)[0]
    with torch.no_grad():
        assert (adapted - hf(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    ckpts = str(tmp_path / "run" / "checkpoints")
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()  # wraps the HF base
    adapted_modules = {n.rpartition(".")[2] for n, m in with_adapter.named_modules() if hasattr(m, "lora_A")}
    assert adapted_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-4)
        torch.testing.assert_close(with_adapter(ids).logits, adapted, rtol=0, atol=1e-4)
