"""PrefetchedBatches: the source's batches in the source's order, a state that resumes after the batches taken (not
those built ahead), the source's errors unchanged, a clean stop."""

from __future__ import annotations

import time
from dataclasses import fields

import pytest
import torch

from mmtrain.data.vlm_batches import MockMediaSamples, VLMBatches
from mmtrain.train.batch_prefetch import PrefetchedBatches


def _mock_batches() -> VLMBatches:
    media = MockMediaSamples(vocab_size=64, seq_length=24, image_token_id=60, num_image_tokens=4, image_size=8, seed=3)
    return VLMBatches(media, None, 0.0, micro_batch_size=2, dp_rank=1, dp_size=2, image_size=8)


def _wait_until_full(ahead: PrefetchedBatches) -> None:
    """Until the thread has built ``depth`` batches ahead (it runs on its own: without this, how far is a race)."""
    deadline = time.monotonic() + 30
    while not ahead._queue.full():
        assert time.monotonic() < deadline, "the prefetch thread built nothing ahead"
        time.sleep(0.005)


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


def test_same_batches_in_the_same_order_and_the_state_of_those_taken():
    plain = _mock_batches()
    expected = [plain.next() for _ in range(7)]
    ahead = PrefetchedBatches(_mock_batches(), depth=3)
    try:
        got = [ahead.next() for _ in range(4)]
        assert all(_same(a, b) for a, b in zip(got, expected))
        _wait_until_full(ahead)
        assert ahead.source.consumed_rows >= (4 + 3) * 4  # it has built 3 batches ahead (one more in hand) ...
        state = ahead.state_dict()
        assert state == {"consumed_rows": 4 * 4}  # ... but saves the position after the 4 taken
    finally:
        ahead.close()
    resumed = PrefetchedBatches(_mock_batches(), depth=2)
    resumed.load_state_dict(state)
    try:
        assert all(_same(resumed.next(), b) for b in expected[4:])
    finally:
        resumed.close()


def test_the_state_before_any_batch_is_the_sources():
    ahead = PrefetchedBatches(_mock_batches())
    assert ahead.state_dict() == {"consumed_rows": 0}
    ahead.close()


class _FailsAtThird:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> torch.Tensor:
        self.n += 1
        if self.n == 3:
            raise ValueError("shards/part-0.tar: sample 'x7' has no image; re-run mmtrain-prep media")
        return torch.tensor([self.n])

    def snapshot(self) -> int:
        return self.n


def test_a_source_error_reaches_the_step_unchanged_at_its_batch():
    ahead = PrefetchedBatches(_FailsAtThird(), depth=4)
    try:
        assert [int(ahead.next()), int(ahead.next())] == [1, 2]
        for _ in range(2):  # and again on a later call
            with pytest.raises(ValueError, match=r"^shards/part-0.tar: sample 'x7' has no image; re-run"):
                ahead.next()
    finally:
        ahead.close()
    assert ahead._thread is None


def test_close_stops_a_thread_blocked_on_a_full_queue_and_a_started_one_takes_no_state():
    ahead = PrefetchedBatches(_mock_batches(), depth=1)
    ahead.next()
    with pytest.raises(RuntimeError, match="before the first next"):
        ahead.load_state_dict({"consumed_rows": 0})
    thread = ahead._thread
    ahead.close()
    assert not thread.is_alive()


class _EnergonLike:
    """A training loader's interface as EnergonRows uses it: its state is that of the samples it has read."""

    training, first_micro_batch = True, 0

    def __init__(self) -> None:
        self.rows = _mock_batches().media
        self.read = 0

    def __next__(self):
        self.read += 1
        return self.rows.row(self.read - 1)

    def state_dict(self, consumed: int) -> dict:
        assert consumed == self.read, "a rank's state is taken at the count it has read"
        return {"consumed_micro_batches": consumed}

    def gather_state_dicts(self, own: dict) -> dict:
        return {**own, "gathered": True}


def test_a_streams_state_is_the_one_taken_after_the_last_batch_used():
    from mmtrain.data.vlm_batches import EnergonRows

    ahead = PrefetchedBatches(VLMBatches(EnergonRows(_EnergonLike()), None, 0.0, 1, 0, 1, image_size=8), depth=3)
    try:
        ahead.next(), ahead.next()
        _wait_until_full(ahead)
        state = ahead.state_dict()
    finally:
        ahead.close()
    assert ahead.source.media.loader.read >= 2 + 3
    assert state == {"consumed_rows": 2, "version": 2, "energon": {"consumed_micro_batches": 2, "gathered": True}}
