"""KV-cache generation: equals the model's own forward, batches equal batches of one, sampling is seeded per row,
greedy equals transformers' generate on the weights exported to HF, and the CLI's errors are one line."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.generate import main as generate_main
from mmtrain.inference.engine import ContextLengthError, DecodeEngine, Sequence, generate
from mmtrain.inference.sampling import SamplingError, SamplingParams, filtered_probs
from tests.inference_helpers import tiny_checkpoint, tiny_config, tiny_model, tiny_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [3]]


def _no_cache_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": True, "qkv_bias": True, "tie_embeddings": True},
                                       {"num_experts": 4, "moe_top_k": 2}])
def test_cached_greedy_equals_forward_and_batch_of_one(overrides):
    model = tiny_model(tiny_config(**overrides))
    batch = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, SamplingParams(max_new_tokens=16))
    one = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, SamplingParams(max_new_tokens=16))
    for p, b, o in zip(PROMPTS, batch, one):
        assert b.token_ids == o.token_ids == _no_cache_greedy(model, p, 16)
        assert b.finish_reason == "length"


def test_one_step_ahead_decoding_gives_the_same_tokens():
    """The GPU's overlapped schedule (run on the CPU here): rows that finish, join and sample mid-run."""
    model = tiny_model()
    params = [SamplingParams(max_new_tokens=3 + 4 * i, stop_token_ids=(7,)) for i in range(6)]
    params[4] = SamplingParams(max_new_tokens=9, temperature=0.7, seed=1)  # a sampled row joins a greedy one
    prompts = PROMPTS + [[8, 9], [1, 2, 3]]
    ref = generate(DecodeEngine(model, 2, 64, overlap=False), prompts, params)
    ahead = generate(DecodeEngine(model, 2, 64, overlap=True), prompts, params)
    assert [s.token_ids for s in ahead] == [s.token_ids for s in ref]
    assert [s.finish_reason for s in ahead] == [s.finish_reason for s in ref]


def test_sampled_rows_decode_one_step_ahead_alike():
    """Sampled rows (temperature, top-k, top-p, each its own) with greedy ones, in slots freed and taken again, draw
    from the per-slot parameters the engine keeps on the device: the same tokens as drawn in step, and a row whose
    logits turn NaN ends alone with an error in both schedules."""
    model = tiny_model()
    params = [SamplingParams(max_new_tokens=4 + 3 * (i % 4), temperature=[0.0, 0.8, 1.3, 0.5][i % 4],
                             top_k=[0, 0, 20, 5][i % 4], top_p=[1.0, 0.9, 1.0, 0.7][i % 4], seed=i)
              for i in range(9)]
    prompts = [PROMPTS[i % 4] + [i + 1] for i in range(9)]

    def run(overlap: bool, poison: int | None = None):
        engine = DecodeEngine(model, 3, 64, overlap=overlap)
        if poison is not None:  # the slot's logits are NaN once the sequence of that prompt holds it
            decode = engine._decode

            def poisoned(tokens, positions):
                logits = decode(tokens, positions)
                for s in engine.active.values():
                    if s.prompt_ids == prompts[poison]:
                        logits[s.slot] = float("nan")
                return logits
            engine._decode = poisoned
        return generate(engine, prompts, params)

    ref, ahead = run(False), run(True)
    assert [s.token_ids for s in ahead] == [s.token_ids for s in ref]
    assert len({tuple(s.token_ids) for s in ref}) > 5  # the rows differ (the draws are not all the argmax)
    for overlap in (False, True):
        out = run(overlap, poison=5)
        assert out[5].finish_reason == "error" and "not finite" in out[5].error
        assert [s.token_ids for i, s in enumerate(out) if i != 5] == [s.token_ids for i, s in enumerate(ref) if i != 5]


def test_ids_past_the_tokenizers_vocabulary_are_never_chosen():
    """``vocab_limit``: a model whose head is wider than its tokenizer (a padded vocabulary) never picks the ids the
    tokenizer lacks, greedy or sampled, in step or one step ahead, from prefill on."""
    model = tiny_model()
    with torch.no_grad():  # the head favours the padded ids: without the limit every pick would be one of them
        model.output.weight[40:] *= 50
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1.5, seed=2),
              SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.99, seed=3)]
    for overlap in (False, True):
        free = generate(DecodeEngine(model, 3, 64, overlap=overlap), PROMPTS[:3], params)
        assert any(t >= 40 for s in free for t in s.token_ids)  # the limit below is what keeps them out
        limited = generate(DecodeEngine(model, 3, 64, overlap=overlap, vocab_limit=40), PROMPTS[:3], params)
        assert all(len(s.token_ids) == 6 and max(s.token_ids) < 40 for s in limited)


def test_more_prompts_than_slots_and_bf16():
    model = tiny_model()
    ref = generate(DecodeEngine(model, slots=4, max_len=40), PROMPTS * 2, SamplingParams(max_new_tokens=8))
    two = generate(DecodeEngine(model, slots=2, max_len=40), PROMPTS * 2, SamplingParams(max_new_tokens=8))
    assert [s.token_ids for s in ref] == [s.token_ids for s in two]
    bf16 = tiny_model().to(torch.bfloat16)
    out = generate(DecodeEngine(bf16, slots=3, max_len=40), PROMPTS, SamplingParams(max_new_tokens=8))
    assert all(len(s.token_ids) == 8 for s in out)


def test_sampling_is_seeded_per_row_and_filters():
    model = tiny_model()
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    a = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, params)
    b = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS, params)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    other = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, SamplingParams(
        max_new_tokens=12, temperature=0.9, seed=8))
    assert [s.token_ids for s in a] != [s.token_ids for s in other]
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert (filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [1, 1, 0, 0, 0]
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (probs > 0).tolist() == [1, 1, 0, 0, 0] and abs(float(probs.sum()) - 1) < 1e-6
    assert (filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.01)) > 0).sum() == 1


def test_stops_and_errors():
    model = tiny_model()
    (free,) = generate(DecodeEngine(model, 1, 64), [PROMPTS[0]], SamplingParams(max_new_tokens=10))
    stop_tok = free.token_ids[3]
    (stopped,) = generate(DecodeEngine(model, 1, 64), [PROMPTS[0]],
                          SamplingParams(max_new_tokens=10, stop_token_ids=(stop_tok,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:free.token_ids.index(stop_tok)]
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    (s,) = generate(DecodeEngine(model, 1, 64), [PROMPTS[0]],
                    SamplingParams(max_new_tokens=10, stop=(f"<{free.token_ids[2]}>",)), decode=decode)
    assert s.finish_reason == "stop" and s.text == decode(free.token_ids[:2])
    engine = DecodeEngine(model, 1, 16)
    with pytest.raises(ContextLengthError, match="exceeds the context of 16"):
        engine.submit(Sequence(list(range(10)), SamplingParams(max_new_tokens=7)))
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(SamplingError):
            engine.submit(Sequence([1, 2], SamplingParams(**bad)))


def test_streaming_callback_receives_the_whole_text():
    model = tiny_model()
    pieces = []
    seq = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=9), decode=lambda ids: " ".join(map(str, ids)),
                   on_token=lambda s, text, done: pieces.append((text, done)))
    engine = DecodeEngine(model, 2, 32)
    engine.submit(seq)
    while engine.busy:
        engine.step()
    assert "".join(t for t, _ in pieces) == seq.text and pieces[-1][1] and not any(d for _, d in pieces[:-1])


def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mmtrain.convert.__main__ import main as convert_main

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_config(num_layers=3), tp=2)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [300, 301, 7]]
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    init_distributed()
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    ours = generate(DecodeEngine(model, slots=4, max_len=96), prompts, SamplingParams(max_new_tokens=64))
    for p, s in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
        assert s.token_ids == out[0, len(p):].tolist()


def test_cli_generates_and_writes_jsonl(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    tok = tiny_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello world"}) + "\n\n" + json.dumps({"prompt": "The quick"}) + "\n")
    out = tmp_path / "out.jsonl"
    rc = generate_main(["--ckpt", str(ckpt), "--tokenizer", str(tok), "--prompt", "Numbers", "--prompts-file",
                        str(prompts), "--max-new-tokens", "12", "--output", str(out), "--no-eod-stop"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Numbers", "Hello world", "The quick"]
    assert all(r["tokens"] == 12 and r["finish_reason"] == "length" for r in rows)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["completion"] for p in printed] == [r["completion"] for r in rows]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-p", "0"], "top_p"),
    (["--temperature", "x"], "invalid float"),
    (["--prompts-file", "MISSING"], "cannot read the prompts file"),
    (["--prompts-file", "BAD"], "BAD:2: not a JSON object"),
    (["--tokenizer", "nowhere.model"], "nowhere.model not found"),
    (["--ckpt", "nockpt"], "not a complete mmtrain checkpoint"),
    (["--batch-size", "0"], "--batch-size"),
    (["--prompt", ""], "prompt is empty"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    tiny_checkpoint(tmp_path / "ckpt", tiny_config())
    tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "BAD").write_text('{"prompt": "ok"}\n{oops\n')
    base = {"--ckpt": "ckpt", "--tokenizer": "tok/tokenizer.json", "--prompt": "Hello"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(generate_main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_vlm_prompt_with_an_image_equals_the_uncached_generate():
    from mmtrain.inference.vlm import vlm_prompt_embeds
    from mmtrain.models.vlm import VLMModel
    from tests.vlm_helpers import IMAGE_ID, tiny_vlm_config

    cfg = tiny_vlm_config(audio=False)
    cfg.language.init_std = 0.25
    vlm = VLMModel(cfg)
    vlm.init_weights(2)
    vlm.eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    prompts = [[1, 2] + [IMAGE_ID] * 4 + [5, 6], [IMAGE_ID] * 4 + [7]]
    engine = DecodeEngine(vlm.language, slots=2, max_len=32)
    seqs = [Sequence(p, SamplingParams(max_new_tokens=10), prompt_embeds=vlm_prompt_embeds(vlm, p, images[i:i + 1]))
            for i, p in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    while engine.busy:
        engine.step()
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        assert s.token_ids == vlm.generate(p, images[i:i + 1], max_new_tokens=10)


def test_inference_package_lists_documented_public_names():
    import mmtrain.inference as pkg

    assert (pkg.__doc__ or "").strip() and pkg.__all__
    for name in pkg.__all__:
        assert (getattr(pkg, name).__doc__ or "").strip(), name
