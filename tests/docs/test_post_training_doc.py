"""docs/post-training.md runs as written on the CPU, in a copy of the user guide's folder: chat data prepared with
the guide's SentencePiece tokenizer, SFT, LoRA and its two exports, DPO (frozen reference, then precomputed), and a
chat with the SFT model through mmtrain.serve. What the page says happened is checked after it ran."""

from __future__ import annotations

import json

import numpy as np

from tests.docs.doc_runner import REPO, copy_folder, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "post-training.md"


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_main_path_is_run_and_only_gpu_or_outside_inputs_are_skipped():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    run = "\n".join(b.body for b in blocks if b.kind == "run")
    assert "Llama-3.2-1B-Instruct" not in run and "cuda" not in run  # the commands that run need nothing else
    for needle in ("mmtrain-prep sft", "--config sft.yaml", "peft.lora.rank", "--lora adapter", "--config dpo.yaml",
                   "mmtrain.dpo_reference", "mmtrain.serve", "/v1/chat/completions"):
        assert needle in run, needle
    skipped = [b for b in blocks if b.kind == "skip"]
    assert len(skipped) <= 5 and all(("cuda" in b.body or "Llama" in b.body or "vlm_chats" in b.body) for b in skipped)


def test_post_training_runs_from_the_user_guides_outputs(guide_folder, tmp_path):
    work = copy_folder(guide_folder, tmp_path / "work")
    outputs = run_page(PAGE, work)

    manifest = json.loads((work / "data/chat.manifest.json").read_text())
    assert manifest["tokenizer"]["type"] == "sentencepiece" and manifest["documents"]["written"] == 400
    assert 0 < manifest["loss_tokens"]["tokens"] < manifest["outputs"]["tokens"]["tokens"]
    sft = _metrics(work / "runs/sft/metrics.jsonl")
    assert len(sft) == 30 and sft[-1]["loss"] < sft[0]["loss"] - 0.3
    lora = _metrics(work / "runs/lora/metrics.jsonl")
    assert len(lora) == 30 and lora[-1]["loss"] < lora[0]["loss"]
    # the merged export carries the chat tokenizer: template and special tokens
    merged = work / "runs/lora/merged"
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in merged.iterdir()}
    assert "<|im_end|>" in json.loads((merged / "tokenizer_config.json").read_text())["extra_special_tokens"]
    assert (work / "runs/lora/adapter/adapter_config.json").is_file()
    # DPO: the policy starts as the reference, the margin grows; the precomputed reference gives the same run
    dpo = _metrics(work / "runs/dpo/metrics.jsonl")
    assert abs(dpo[0]["reward_margin"]) < 1e-6 and dpo[-1]["reward_margin"] > dpo[0]["reward_margin"] + 0.3
    assert dpo[-1]["reward_accuracy"] == 1.0
    precomputed = _metrics(work / "runs/dpo_precomputed/metrics.jsonl")
    np.testing.assert_allclose([r["loss"] for r in precomputed], [r["loss"] for r in dpo], rtol=1e-4)
    # the chat answer: one assistant message, ended at <|im_end|>
    chat = next(json.loads(out) for out in outputs.values() if '"chat.completion"' in out)
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"].strip()
    assert "<|im_" not in choice["message"]["content"]
