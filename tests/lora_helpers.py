"""Shared steps of the LoRA / DoRA export tests: a tiny HF Llama imported as an mmtrain weights-only checkpoint,
and the check that a run's merged export and its peft adapter reproduce the adapted model's logits."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_hf_llama_imported(tmp_path: Path):
    """A random tiny ``LlamaForCausalLM`` saved at ``tmp_path/hf`` and imported at ``tmp_path/base``; returns it
    (eval mode) and a (2, 12) batch of token ids."""
    import transformers

    from mmtrain.convert.__main__ import main as convert

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert convert(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    return hf, torch.randint(0, 96, (2, 12))


def assert_exports_give_the_adapted_logits(tmp_path: Path, ckpts: str, ids: torch.Tensor,
                                          adapted: torch.Tensor) -> Path:
    """``mmtrain-to-hf`` of the run at ``ckpts``: the merged weights in transformers, and the peft adapter
    (``--lora adapter``, returned) through ``PeftModel`` on the HF base at ``tmp_path/hf``, give ``adapted``."""
    import peft
    import transformers

    from mmtrain.convert.__main__ import main as convert

    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()  # the family's class
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-4)
    assert convert(["mmtrain-to-hf", "--ckpt", ckpts, "--out", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, adapted, rtol=0, atol=1e-4)
    return tmp_path / "adapter"
