"""The step line's time left (median of the recent step times) and the VLM blend's log line."""

from __future__ import annotations

import logging

from mmtrain.data.blend_spec import BlendEntry
from mmtrain.data.vlm_sources import describe_blend
from mmtrain.train.metrics import MetricsLogger, StepTimes, format_duration, format_step_line


def test_eta_is_steps_left_times_the_median_of_the_last_20():
    times = StepTimes()
    assert times.eta(1, 10) is None
    times.add(30.0)  # a first step with compilation
    for _ in range(4):
        times.add(1.0)
    assert times.eta(5, 105) == 100.0  # the median ignores the slow first step
    for _ in range(30):
        times.add(2.0)
    assert times.eta(35, 135) == 200.0  # only the last 20 count
    times.add(float("nan"))
    times.add("n/a")
    assert times.eta(135, 135) == 0.0


def test_durations_and_the_line():
    assert [format_duration(s) for s in (4.4, 65, 3 * 3600 + 7 * 60 + 20, 2 * 86400 + 4 * 3600)] == \
        ["4s", "1m05s", "3h07m", "2d04h"]
    assert format_step_line(3, 10, {"loss": 1.0, "step_time_s": 0.5}, eta_s=3.5) == \
        "step 3/10 | loss 1.0000 | 500ms | eta 4s"


def test_logger_prints_the_eta(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, rank=0, total_steps=10)
    with caplog.at_level(logging.INFO):
        for step in (1, 2):
            logger.log_step(step, {"loss": 1.0, "step_time_s": 2.0})
    logger.close()
    assert "eta 16s" in caplog.text


def test_vlm_blend_line_names_text_and_media_datasets():
    entries = [BlendEntry("/d/web_text", 0.3, "indexed", "b.yaml: datasets[0]"),
               BlendEntry("/d/books", 0.1, "indexed", "b.yaml: datasets[1]"),
               BlendEntry("/d/captions", 0.6, "energon", "b.yaml: datasets[2]")]
    line = describe_blend("train", entries, 0.4)
    assert line == ("train VLM blend: 3 dataset(s): text 0.4000 of rows (web_text 0.3000, books 0.1000); "
                    "media 0.6000 of rows (captions 0.6000); the text part's own blend follows")
    media_only = describe_blend("valid", [BlendEntry("/d/caps", None, "energon", "b.yaml: valid[0]")], 0.0)
    assert media_only == "valid VLM blend: 1 dataset(s): media 1.0000 of rows (caps)"
