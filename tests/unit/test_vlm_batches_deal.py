"""How VLMBatches deals a round of rows to the data-parallel ranks when media rows come from energon streams: every
row once, ``mbs`` per rank, and each rank's media rows exactly the next samples of its own stream (``B + r + k·dp``),
for any text share, micro-batch size, dp size and starting point."""

from __future__ import annotations

from types import SimpleNamespace

from mmtrain.data.vlm_batches import EnergonRows, VLMBatches


def _batches(rank: int, dp: int, mbs: int, fraction: float, first_media: int) -> VLMBatches:
    loader = SimpleNamespace(training=True, first_micro_batch=first_media)
    return VLMBatches(EnergonRows(loader), [[0]] if fraction else None, fraction, mbs, rank, dp, image_size=8)


def test_rows_of_a_round_go_to_the_rank_whose_stream_holds_them():
    cases = [(dp, mbs, f, start) for dp in (1, 2, 3, 4) for mbs in (1, 2, 3) for f in (0.0, 0.2, 0.5, 0.9)
             for start in (0, 5)]
    for dp, mbs, fraction, start_round in cases:
        _check_deal(dp, mbs, fraction, start_round)


def _check_deal(dp: int, mbs: int, fraction: float, start_round: int) -> None:
    first_row = start_round * dp * mbs
    media_at_start = first_row - _batches(0, dp, mbs, fraction, 0)._texts_before(first_row)
    ranks = [_batches(r, dp, mbs, fraction, media_at_start) for r in range(dp)]
    taken = [0] * dp
    for k in range(12):
        first = first_row + k * dp * mbs
        rows = [b._my_rows(first) for b in ranks]
        assert all(len(r) == mbs for r in rows)
        assert sorted(n for r in rows for n in r) == list(range(first, first + dp * mbs))
        for r, b in enumerate(ranks):
            for n in rows[r]:
                if not b._is_text(n):  # media sample m = n - texts before n: the next of rank r's stream
                    assert n - b._texts_before(n) == media_at_start + r + taken[r] * dp, (dp, mbs, fraction, n)
                    taken[r] += 1
