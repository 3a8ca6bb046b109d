"""Step durations (``mmtrain.train.step_readout.StepClock``): from the previous step's end, except after a pause."""

from __future__ import annotations

import torch

from mmtrain.train.step_readout import StepClock, queue_readout


def test_a_step_starts_where_the_previous_ended_unless_the_clock_paused():
    clock = StepClock(torch.device("cpu"))
    first = clock.begin()
    end1 = clock.end()
    assert clock.begin() is end1  # host work between two steps is the second step's
    end2 = clock.end()
    clock.pause()  # e.g. a checkpoint save after step 2
    third = clock.begin()
    assert third is not end2 and third >= end2
    assert clock.seconds(first, end1) >= 0 and clock.seconds(third, clock.end()) >= 0


def test_the_readout_holds_loss_norm_flag_then_the_stats():
    stats = torch.tensor([6.0, 3.0, 4.0], dtype=torch.float64)
    values, ready = queue_readout(stats[0] / stats[1], torch.tensor(0.5), torch.tensor(False), stats)
    assert ready is None and values.tolist() == [2.0, 0.5, 0.0, 6.0, 3.0, 4.0]
