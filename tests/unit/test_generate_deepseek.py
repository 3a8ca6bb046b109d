"""KV-cache generation of the DeepSeek-V3 family (MLA: the latent + RoPE key cached, attention in the latent
space; group-limited sigmoid MoE with a shared expert): greedy equals the model's own uncached forward and
``transformers``' DeepseekV3ForCausalLM ``generate`` on the weights exported with the family's HF adapter, batch
rows equal their batch-of-one runs, and ``mmtrain.generate`` / ``mmtrain.serve`` run a DeepSeek checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.generate import main as generate_main
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.model.kv_cache import LatentKVCache
from mmtrain.inference.sampling import SamplingParams
from tests.inference_helpers import tiny_checkpoint, tiny_deepseek_config, tiny_model, tiny_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [300, 301, 7]]
# no low-rank queries, halves RoPE, tied embeddings, YaRN (its attention factor and softmax scale)
OTHER_SHAPE = dict(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True, rope_scaling="yarn",
                   yarn_factor=4.0, yarn_original_max_position_embeddings=32, yarn_mscale=1.0,
                   yarn_mscale_all_dim=1.0, max_position_embeddings=128)


def _uncached_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_cache_holds_latents_and_batches_equal_batches_of_one():
    model = tiny_model(tiny_deepseek_config())
    engine = DecodeEngine(model, slots=4, max_len=64)
    cfg = model.cfg
    assert isinstance(engine.cache, LatentKVCache)
    assert engine.cache.entries[0].shape == (4, 1, 64, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    batch = generate(engine, PROMPTS, SamplingParams(max_new_tokens=12))
    one = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, SamplingParams(max_new_tokens=12))
    for p, b, o in zip(PROMPTS, batch, one):
        assert b.token_ids == o.token_ids == _uncached_greedy(model, p, 12)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=4)
    a = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, sampled)
    b = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, sampled)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


@pytest.mark.parametrize("shape", [{}, OTHER_SHAPE], ids=["q_lora", "direct_q_yarn_tied"])
def test_greedy_equals_transformers_generate(tmp_path, shape):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from mmtrain.convert.__main__ import main as convert_main
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_deepseek_config(**shape), tp=2)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    init_distributed()
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    ours = generate(DecodeEngine(model, slots=4, max_len=96), PROMPTS, SamplingParams(max_new_tokens=32))
    for p, s in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert s.token_ids == out[0, len(p):].tolist()


def test_generate_cli_and_server_run_a_deepseek_checkpoint(tmp_path, capsys):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from mmtrain.serve import build_server_app

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_deepseek_config(), tp=2)
    tok = tiny_tokenizer(tmp_path / "tok")
    out = tmp_path / "out.jsonl"
    assert generate_main(["--ckpt", str(ckpt), "--tokenizer", str(tok), "--prompt", "Hello world", "--prompt",
                          "The quick", "--max-new-tokens", "10", "--output", str(out), "--no-eod-stop"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [10, 10] and all(r["finish_reason"] == "length" for r in rows)
    capsys.readouterr()
    app, engine = build_server_app(ckpt, tok, model_name="ds", slots=2, context=64, device="cpu")
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"model": "ds", "prompt": "Hello world", "max_tokens": 10,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == rows[0]["completion"]
            bad = client.post("/v1/completions", json={"model": "ds", "prompt": [600], "max_tokens": 3})
            assert bad.status_code == 400 and "0..511" in bad.text
    finally:
        engine.close()
