"""docs/quantization.md runs as written on the CPU, in a copy of the user guide's folder: FP8, W4A16 RTN and W4A16
GPTQ folders of the guide's model, generate and evaluate on them, transformers' generate on one. What the page says
happened is checked after it ran: the folders' formats, FP8 within 1% of the dense perplexity, GPTQ no worse than
round-to-nearest (fixed seeds)."""

from __future__ import annotations

import json

import pytest

from tests.docs.doc_runner import REPO, copy_folder, run_page
from tests.docs.guide_blocks import page_blocks

PAGE = REPO / "docs" / "quantization.md"


def test_every_command_of_the_page_runs_on_the_cpu():
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    assert not [b for b in blocks if b.kind == "skip"]
    run = "\n".join(b.body for b in blocks if b.kind == "run")
    for needle in ("--scheme fp8", "--method gptq", "mmtrain.generate --ckpt quant/", "mmtrain.evaluate --ckpt quant/",
                   "AutoModelForCausalLM.from_pretrained('quant/"):
        assert needle in run, needle


def test_quantization_runs_from_the_user_guides_outputs(guide_folder, tmp_path):
    pytest.importorskip("compressed_tensors")
    work = copy_folder(guide_folder, tmp_path / "work")
    outputs = run_page(PAGE, work)
    for name, fmt in (("fp8", "float-quantized"), ("w4a16-rtn", "pack-quantized"), ("w4a16-gptq", "pack-quantized")):
        config = json.loads((work / "quant" / name / "config.json").read_text())["quantization_config"]
        assert config["format"] == fmt and config["quant_method"] == "compressed-tensors"
        assert (work / "quant" / name / "tokenizer.json").is_file()
    made = json.loads((work / "quant/w4a16-gptq/mmtrain-quantization.json").read_text())
    assert made["method"] == "gptq" and made["calibration"]["samples"] == 128 and made["group_size"] == 16
    ppl = {name: json.loads((work / "quant" / f"{name}.json").read_text())["perplexity"]
           for name in ("dense", "fp8", "w4a16-rtn", "w4a16-gptq")}
    assert abs(ppl["fp8"] / ppl["dense"] - 1) < 0.01, ppl
    assert ppl["w4a16-gptq"] <= ppl["w4a16-rtn"], ppl
    completion = next(json.loads(line) for out in outputs.values() for line in out.splitlines()
                      if line.startswith('{"prompt"'))
    assert completion["prompt"] == "def" and completion["completion"].strip()
