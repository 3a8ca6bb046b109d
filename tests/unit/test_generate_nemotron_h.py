"""Decoding the nemotron_h family (``mmtrain/models/nemotron_h/decode.py``): the recurrent state cache (per Mamba
layer a convolution state and an fp32 scan state that do not grow with the context, the static KV cache for the
attention layers), right-padded batched prefills that leave each row's state as after its own last token, prompts
prefilled in pieces, reused slots starting from zero state; greedy ``mmtrain.generate`` equal to transformers'
``generate`` on the converted model, batch rows equal to their runs alone and to the uncached forward; a chat
completion streamed by ``mmtrain.serve`` from a hybrid checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.inference.decoder import kv_cache_bytes
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.sampling import SamplingParams
from mmtrain.models.nemotron_h.decode import HybridStateCache
from tests.inference_helpers import (hf_greedy, load_whole_model, tiny_checkpoint, tiny_hf_nemotron_h, tiny_model,
                                     tiny_nemotron_h_config, tiny_tokenizer, uncached_greedy)

pytestmark = pytest.mark.unit
# chunks of 4 tokens: the longer prompts take the chunked scan over several chunks, the short ones one partial chunk
PROMPTS = [list(range(40, 57)), [11, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100, 101, 7]]


def test_the_cache_holds_constant_mamba_state_and_grows_only_for_attention():
    model = tiny_model(tiny_nemotron_h_config())  # M*M-MM: 4 Mamba layers, 1 attention layer
    cfg = model.cfg
    short, long = (model.new_kv_cache(3, n, torch.bfloat16, "meta") for n in (16, 4096))
    assert isinstance(short, HybridStateCache) and len(short.conv) == len(short.ssm) == 4 and len(short.k) == 1
    conv_width = cfg.mamba_inner_size + 2 * cfg.n_groups * cfg.ssm_state_size
    for cache in (short, long):
        assert {tuple(t.shape) for t in cache.conv} == {(3, conv_width, cfg.conv_kernel - 1)}
        assert {(tuple(t.shape), t.dtype) for t in cache.ssm} == {
            ((3, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), torch.float32)}
    assert short.k[0].shape == (3, 2, 16, 8) and long.k[0].shape == (3, 2, 4096, 8)
    mamba_only = tiny_model(tiny_nemotron_h_config(hybrid_override_pattern="M-M-"))
    assert kv_cache_bytes(mamba_only, 3, 16, torch.bfloat16) == kv_cache_bytes(mamba_only, 3, 4096, torch.bfloat16)
    assert kv_cache_bytes(model, 3, 4096, torch.bfloat16) > kv_cache_bytes(model, 3, 16, torch.bfloat16)


def test_a_padded_prefill_leaves_each_row_as_after_its_own_last_token():
    """The engine's batched prefill right-pads prompts to the longest: the padded rows' convolution and scan
    states (and their logits) equal those of the row prefilled alone; a reused slot starts from zero state."""
    model = tiny_model(tiny_nemotron_h_config())
    S = len(PROMPTS[0])
    tokens = torch.zeros(len(PROMPTS), S, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        tokens[b, :len(p)] = torch.tensor(p)
    last = torch.tensor([len(p) - 1 for p in PROMPTS])
    slots = torch.tensor([3, 0, 2, 1])
    with torch.no_grad():
        cache = model.new_kv_cache(4, 32, torch.float32, "cpu")
        for t in cache.conv + cache.ssm:  # what the slots' Mamba states held before: never read at position 0
            t.fill_(float("nan"))
        batched = model.decode(cache, torch.arange(S).expand(4, S), tokens, slots_B=slots, last_index_B=last)
        for b, p in enumerate(PROMPTS):
            alone = model.new_kv_cache(1, 32, torch.float32, "cpu")
            logits = model.decode(alone, torch.arange(len(p))[None], torch.tensor([p]))
            torch.testing.assert_close(batched[b:b + 1], logits, rtol=1e-5, atol=1e-5)
            row = int(slots[b])
            for mine, reference in zip(cache.conv + cache.ssm, alone.conv + alone.ssm):
                torch.testing.assert_close(mine[row:row + 1], reference, rtol=1e-5, atol=1e-5)


def test_a_prompt_prefilled_in_pieces_continues_the_state():
    model = tiny_model(tiny_nemotron_h_config())
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        whole_cache = model.new_kv_cache(1, 32, torch.float32, "cpu")
        whole = model.decode(whole_cache, torch.arange(17)[None], prompt)
        cache = model.new_kv_cache(1, 32, torch.float32, "cpu")
        model.decode(cache, torch.arange(6)[None], prompt[:, :6])
        pieces = model.decode(cache, torch.arange(6, 17)[None], prompt[:, 6:])
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    for mine, reference in zip(cache.buffers(), whole_cache.buffers()):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


def test_batches_equal_batches_of_one_and_the_uncached_forward():
    model = tiny_model(tiny_nemotron_h_config())
    batch = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, SamplingParams(max_new_tokens=12))
    one = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, SamplingParams(max_new_tokens=12))
    assert [b.token_ids for b in batch] == [o.token_ids for o in one]
    for row in (0, 1):  # the longest prompt and the shortest
        assert batch[row].token_ids == uncached_greedy(model, PROMPTS[row], 12)
    assert min(len(set(s.token_ids)) for s in batch) > 3  # not one token repeated: the comparison has teeth
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=4)
    a = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, sampled)
    b = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, sampled)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_greedy_equals_transformers_generate(tmp_path):
    pytest.importorskip("transformers")
    from mmtrain.convert.__main__ import main as convert_main

    hf = tiny_hf_nemotron_h()
    hf.save_pretrained(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2"]) == 0
    new, prompts = 24, PROMPTS[:3]
    ours = generate(DecodeEngine(load_whole_model(tmp_path / "c"), slots=3, max_len=64), prompts,
                    SamplingParams(max_new_tokens=new))
    assert [s.token_ids for s in ours] == [hf_greedy(hf, p, new) for p in prompts]
    assert min(len(set(s.token_ids)) for s in ours) > 3


def test_the_server_streams_a_chat_completion_from_a_hybrid_checkpoint(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.serve import build_server_app

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_nemotron_h_config(), tp=2)
    tok = tiny_tokenizer(tmp_path / "tok")
    app, engine = build_server_app(ckpt, tok, model_name="hybrid", slots=2, context=64, device="cpu")
    body = {"model": "hybrid", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 12,
            "temperature": 0}
    try:
        with TestClient(app) as client:
            whole = client.post("/v1/chat/completions", json=body)
            assert whole.status_code == 200, whole.text
            events = []
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        engine.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == whole.json()["choices"][0]["message"]["content"] and streamed
    tokenizer = load_tokenizer(tok)  # the chat template's rendering, completed alone
    prompt = tokenizer.encode("<|user|>Hello world\n<|assistant|>")
    (alone,) = generate(DecodeEngine(engine.engine.model, 1, 64), [prompt],
                        SamplingParams(12, stop_token_ids=(tokenizer.eod_id,)), decode=tokenizer.decode)
    assert streamed == alone.text
