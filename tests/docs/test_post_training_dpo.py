"""docs/post-training.md section 4 (DPO): its GPU commands for a Hugging Face chat model (the block the page
test skips: tests/docs/test_post_training_doc.py runs the CPU path, precomputed reference included) run as written,
from the command line, in order, in an empty folder. Only what this machine cannot have is swapped:
./Llama-3.2-1B-Instruct is a tiny stand-in (the chat tokenizer of the tests and a random 2-layer Llama of its
vocabulary), runs/sft/checkpoints (the SFT result the commands start from) is that stand-in imported, and
train.device=cuda becomes the CPU with a few steps of short samples."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from tests.docs.doc_runner import guide_env
from tests.docs.guide_blocks import page_blocks

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
    (gpu,) = [b for b in blocks if b.kind == "skip" and "Llama-3.2-1B-Instruct" in b.body]
    assert "train.device=cuda" in gpu.body and "--nproc_per_node 2" in gpu.body and "min_lr" not in gpu.body
    script = gpu.body.replace(*DEVICE_AND_SIZES)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=guide_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (f"docs/post-training.md section 4: exit {proc.returncode}\n{script}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    rows = _metrics(work / "runs/dpo/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["loss"] - 0.6931472) < 1e-4  # the policy starts as the reference
    assert "reward_margin" in rows[0]
