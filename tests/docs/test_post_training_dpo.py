"""docs/post-training.md section 4 (DPO) runs as written: its shell blocks, from the command line, in order, in an
empty folder, with its dpo.yaml. Only what this machine cannot have is swapped: ./Llama-3.2-1B-Instruct is a tiny
stand-in (the chat tokenizer of the tests and a random 2-layer Llama of its vocabulary), runs/sft/checkpoints (the
SFT result the section starts from) is that stand-in imported, and train.device=cuda becomes the CPU with a few
steps of short samples."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from tests.docs.guide_blocks import page_blocks
from tests.docs.test_user_guide import guide_env

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "post-training.md"
DEVICE_AND_SIZES = ("train.device=cuda", "train.device=cpu train.steps=3 data.seq_length=64")


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _stand_in(work: Path) -> None:
    """./Llama-3.2-1B-Instruct (tokenizer + tiny model), runs/sft/checkpoints, prefs.jsonl."""
    import torch
    import transformers

    from mmtrain.convert.__main__ import main as convert
    from tests.sft_helpers import build_chat_tokenizer

    model = work / "Llama-3.2-1B-Instruct"
    build_chat_tokenizer(model)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=640, max_position_embeddings=128)).save_pretrained(model)
    assert convert(["hf-to-mmtrain", "--hf", str(model), "--out", str(work / "runs/sft/checkpoints")]) == 0
    rng = random.Random(0)
    words = "the cat sat on a mat and ran to the big red house".split()
    (work / "prefs.jsonl").write_text("".join(json.dumps({
        "prompt": " ".join(rng.choices(words, k=4)), "chosen": "yes " + " ".join(rng.choices(words, k=3)),
        "rejected": "no " + " ".join(rng.choices(words, k=3))}) + "\n" for _ in range(16)))


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dpo_section_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    work = tmp_path / "dpo"
    work.mkdir()
    _stand_in(work)
    blocks = page_blocks(_section(PAGE.read_text(encoding="utf-8"), "4. DPO"))
    assert [b.kind for b in blocks] == ["run", "file", "run"]
    env = guide_env()
    for block in blocks:
        if block.kind == "file":
            (work / block.file).write_text(block.body, encoding="utf-8")
            continue
        assert "train.device=cuda" in block.body and "--nproc_per_node 2" in block.body
        script = block.body.replace(*DEVICE_AND_SIZES)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (f"docs/post-training.md section 4: exit {proc.returncode}\n{script}\n"
                                      f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    with_model = _metrics(work / "runs/dpo/metrics.jsonl")
    precomputed = _metrics(work / "runs/dpo_precomputed/metrics.jsonl")
    assert [r["step"] for r in with_model] == [r["step"] for r in precomputed] == [1, 2, 3]
    assert abs(with_model[0]["loss"] - 0.6931472) < 1e-4  # the policy starts as the reference
    assert "reward_margin" in with_model[0] and (work / "data/prefs.dpo_reference.json").is_file()
    for a, b in zip(with_model, precomputed):  # the table stands in for the reference model (bf16 forward passes
        assert abs(a["loss"] - b["loss"]) < 1e-3 and a["lr"] == b["lr"]  # of other batch shapes: not bit-equal)
