"""Sampling is finite for every value the server's schema accepts, and one sequence's failure (its draw, its
prefill, its text) ends that sequence alone: the others' tokens are those of their runs alone (issue #29 item 1)."""

from __future__ import annotations

import pytest
import torch

from mmtrain.inference.engine import DecodeEngine, Sequence, generate
from mmtrain.inference.sampling import RowRandom, SamplingParams, filtered_probs, inverse_cdf, next_tokens
from tests.inference_helpers import tiny_model

TINY_VALUES = [1e-38, 1e-46, 5e-324]


@pytest.mark.parametrize("temperature", [*TINY_VALUES, 1e-6, 1.0, 100.0])
@pytest.mark.parametrize("top_p", [*TINY_VALUES, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_filtered_probs_are_a_distribution_at_the_edges(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=g) * 30
    logits[7] = logits.max() + 1e-3  # the most likely token, barely
    probs = filtered_probs(logits, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    assert torch.isfinite(probs).all() and (probs >= 0).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert probs[7] > 0  # the most likely token always stays
    if temperature < 1e-37 or top_p < 1e-37 or top_k == 1:
        assert probs[7] == 1  # greedy-equivalent
    token = int(torch.multinomial(probs, 1, generator=g))
    assert probs[token] > 0


def test_a_row_whose_draw_fails_is_named_and_the_others_are_drawn():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    logits[1, 5] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, seed=0), None]
    chosen, tokens, failed = next_tokens(logits, params, [RowRandom(0), RowRandom(0), None])
    assert list(failed) == [1] and "sampling failed" in failed[1]
    _, alone, _ = next_tokens(logits[:1], params[:1], [RowRandom(0)])
    assert tokens[0] == alone[0] and tokens[2] == int(logits[2].argmax()) and chosen.tolist() == tokens


def test_a_rows_draws_are_its_own_whatever_its_batch():
    """A row's token depends on its logits, parameters and random stream only: alone, among other rows, at any
    position of the batch; its stream advances one key per draw."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=g)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=5), None, SamplingParams(temperature=1.3, top_p=0.9,
              seed=6), SamplingParams(temperature=1.0, seed=7)]
    streams = [RowRandom(5), None, RowRandom(6), RowRandom(7)]
    _, together, _ = next_tokens(logits, params, streams)
    for b in (0, 2, 3):
        _, alone, _ = next_tokens(logits[b:b + 1], [params[b]], [RowRandom(params[b].seed)])
        _, reversed_batch, _ = next_tokens(logits.flip(0), params[::-1], [s and RowRandom(s.seed) for s in streams[::-1]])
        assert together[b] == alone[0] == reversed_batch[3 - b]
    assert [s.draws for s in streams if s] == [1, 1, 1]


def test_the_draws_follow_the_filtered_distribution():
    """Many uniforms of one row's stream: the tokens' frequencies match its filtered probabilities (a bound of a few
    standard errors), and a filtered-out token is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = filtered_probs(logits, SamplingParams(temperature=0.8, top_p=0.9))
    n, stream = 40000, RowRandom(11)
    uniforms = torch.tensor([stream.next_uniform() for _ in range(n)], dtype=torch.float64)
    drawn = inverse_cdf(probs.expand(n, 6), uniforms)
    freq = torch.bincount(drawn, minlength=6).double() / n
    assert float((freq - probs.double()).abs().max()) < 0.01
    assert bool((freq[probs == 0] == 0).all()) and int((probs == 0).sum()) >= 1
    assert 0.45 < float(uniforms.mean()) < 0.55 and len(set(uniforms.tolist())) == n


def _greedy_alone(model, prompt, n):
    (seq,) = generate(DecodeEngine(model, 1, 64), [prompt], SamplingParams(n))
    return seq.token_ids


def test_a_sequence_whose_draw_fails_ends_alone():
    model = tiny_model()
    engine = DecodeEngine(model, 3, 64)
    ended = []
    kept = Sequence([5, 6, 7], SamplingParams(24))
    doomed = Sequence([9, 10], SamplingParams(24, temperature=1.0, seed=3),
                      on_token=lambda s, text, done: done and ended.append(s.finish_reason))
    for s in (kept, doomed):
        engine.submit(s)
    engine.step()  # both prefilled
    doomed.params.temperature = float("nan")  # its next draw fails (the checks ran at submit)
    while engine.busy:
        engine.step()
    assert doomed.finish_reason == "error" and "sampling failed" in doomed.error and ended == ["error"]
    assert len(doomed.token_ids) == 1 and engine.slots == len(engine._free)  # every slot is free again
    assert kept.finish_reason == "length" and kept.token_ids == _greedy_alone(model, [5, 6, 7], 24)


def test_a_sequence_whose_prefill_fails_ends_alone_and_its_batch_mates_go_on():
    model = tiny_model()
    engine = DecodeEngine(model, 3, 64)
    width = model.embed.embedding_dim
    bad = Sequence([1, 2, 3], SamplingParams(8), prompt_embeds=torch.zeros(3, width + 1))  # a wrong width
    good = [Sequence([5, 6, 7], SamplingParams(8)), Sequence([11, 12], SamplingParams(8))]
    for s in (good[0], bad, good[1]):
        engine.submit(s)  # they join together: one batched prefill, which fails
    while engine.busy:
        engine.step()
    assert bad.finish_reason == "error" and bad.error.startswith("prefill failed") and not bad.token_ids
    assert [s.token_ids for s in good] == [_greedy_alone(model, [5, 6, 7], 8), _greedy_alone(model, [11, 12], 8)]


def test_a_sequence_whose_text_fails_ends_alone():
    model = tiny_model()
    engine = DecodeEngine(model, 2, 64)

    def broken_decode(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")
    kept = Sequence([5, 6, 7], SamplingParams(10), decode=lambda ids: "x" * len(ids),
                    on_token=lambda s, text, done: None)
    doomed = Sequence([11, 12], SamplingParams(10), decode=broken_decode, on_token=lambda s, text, done: None)
    for s in (kept, doomed):
        engine.submit(s)
    while engine.busy:
        engine.step()
    assert doomed.finish_reason == "error" and "UnicodeDecodeError" in doomed.error
    assert kept.finish_reason == "length" and kept.text == "x" * 10
    assert kept.token_ids == _greedy_alone(model, [5, 6, 7], 10)
