"""Completions keep their leading space (issue #30, item 1): what the generate CLI prints, /v1/completions with and
without echo, and the streamed pieces all satisfy prompt text + completion == decode(prompt ids + completion ids),
for a SentencePiece model and for a tokenizer.json whose decoder drops the first token's leading space."""

from __future__ import annotations

import json

import pytest

from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.generate import main as generate_main
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.sampling import SamplingParams
from tests.eval_helpers import train_sentencepiece
from tests.inference_helpers import metaspace_tokenizer, tiny_checkpoint, tiny_config, tiny_model

PROMPTS = ["The quick brown", "Hello world,", "Numbers 12", "lazy", "def f(x):", "hello model", "Caf", "The"]
NEW = 6


@pytest.fixture(scope="module", params=["sentencepiece", "tokenizer.json"])
def tok_path(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return train_sentencepiece(folder) if request.param == "sentencepiece" else metaspace_tokenizer(folder)


def _references(tok, model, prompts: list[str]) -> list:
    """Each prompt's greedy completion, one at a time (the server's answers equal these)."""
    assert all(tok.decode(tok.encode(p)) == p for p in prompts)  # the prompts round-trip
    stops = () if tok.eod_id is None else (tok.eod_id,)
    return [generate(DecodeEngine(model, 1, 64), [tok.encode(p)], SamplingParams(NEW, stop_token_ids=stops),
                     decode=tok.decode)[0] for p in prompts]


def _meaningful(tok, prompts: list[str], seqs) -> None:
    # at least one completion starts a new word: decoded alone it would lose its leading space
    assert any(tok.decode(s.token_ids) != tok.decode(tok.encode(p) + s.token_ids)[len(p):]
               for p, s in zip(prompts, seqs))


def test_the_generate_cli_prints_text_that_follows_the_prompt(tok_path, tmp_path, capsys):
    tok = load_tokenizer(tok_path)
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_config(vocab_size=tok.vocab_size))
    out = tmp_path / "out.jsonl"
    argv = ["--ckpt", str(ckpt), "--tokenizer", str(tok_path), "--max-new-tokens", str(NEW), "--output", str(out)]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert generate_main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["completion"] for p in printed] == [r["completion"] for r in rows]
    for r in rows:
        assert r["prompt"] + r["completion"] == tok.decode(tok.encode(r["prompt"]) + r["token_ids"]), r
    assert any(tok.decode(r["token_ids"]) != r["completion"] for r in rows)  # some start a new word


def test_a_stop_string_can_match_the_completions_leading_space(tok_path):
    tok = load_tokenizer(tok_path)
    model = tiny_model(tiny_config(vocab_size=tok.vocab_size))
    refs = _references(tok, model, PROMPTS)
    _meaningful(tok, PROMPTS, refs)
    texts = [tok.decode(tok.encode(p) + ref.token_ids)[len(p):] for p, ref in zip(PROMPTS, refs)]
    spaced = [(p, text) for p, text in zip(PROMPTS, texts) if text[:1] == " " and text.strip()]
    for p, text in spaced:
        stop = text[:text.index(text.strip()[0]) + 1]  # the leading space(s) and one character
        (s,) = generate(DecodeEngine(model, 1, 64), [tok.encode(p)],
                        SamplingParams(NEW, stop_token_ids=(tok.eod_id,), stop=(stop,)), decode=tok.decode)
        assert s.finish_reason == "stop" and s.text == ""


@pytest.fixture(scope="module")
def served(tok_path):
    from fastapi.testclient import TestClient

    from mmtrain.inference.openai_app import build_app
    from mmtrain.inference.server_engine import EngineThread

    tok = load_tokenizer(tok_path)
    model = tiny_model(tiny_config(vocab_size=tok.vocab_size))
    engine = EngineThread(DecodeEngine(model, 4, 64))
    try:
        with TestClient(build_app(engine, tok, "tiny")) as client:
            yield client, tok, model
    finally:
        engine.close()


def _stream(client, body) -> list[str]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["text"] for e in events[:-1]]


def test_completions_echo_and_streams_follow_the_prompt(served):
    client, tok, model = served
    refs = _references(tok, model, PROMPTS)
    for p, ref in zip(PROMPTS, refs):
        ids = tok.encode(p)
        whole = tok.decode(ids + ref.token_ids)
        for prompt in (p, ids):  # text, and token ids
            body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
            got = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert p + got == whole and got == ref.text, (p, got, whole)
            assert client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"] == whole
        assert "".join(_stream(client, {**body, "prompt": p})) == ref.text
        assert "".join(_stream(client, {**body, "echo": True})) == whole  # token ids, echoed
    _meaningful(tok, PROMPTS, refs)


def test_a_token_id_prompt_that_ends_inside_a_character_is_echoed_consistently(served):
    client, tok, model = served
    ids = tok.encode("ok 🦙")
    if tok.decode(ids) != "ok 🦙":
        pytest.skip("this tokenizer has no byte fallback (the emoji is <unk>)")
    prompt = ids[:-1]  # the emoji's last byte is missing
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    (ref,) = generate(DecodeEngine(model, 1, 64), [prompt], SamplingParams(NEW, stop_token_ids=(tok.eod_id,)),
                      decode=tok.decode)
    assert got == ref.text and echoed == tok.decode(prompt + ref.token_ids)
    assert "".join(_stream(client, {**body, "echo": True})) == echoed
