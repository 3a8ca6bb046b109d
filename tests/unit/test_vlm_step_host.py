"""The VLM training step's host side: the placeholder check runs on the batch's host copy (same one-line errors)
and nothing in the step reads the device back. A model on the ``meta`` device stands in for the GPU: its tensors
hold no values, so any read-back (``.cpu()``, ``.item()``, ``int()``, ``.tolist()``) of a device tensor raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmtrain.inference.vlm import vlm_prompt_embeds
from mmtrain.models.vlm import MediaPlaceholderError, VLMModel, splice_media
from mmtrain.train.build_vlm import vlm_forward_step
from tests.vlm_helpers import IMAGE_ID, make_batch, tiny_vlm_config

ONE_RANK = SimpleNamespace(dims=SimpleNamespace(cp=1), coord=SimpleNamespace(cp=0))
META = torch.device("meta")


def _meta_model(audio: bool = True) -> VLMModel:
    with META:
        return VLMModel(tiny_vlm_config(audio))


def test_the_training_step_on_a_device_reads_nothing_back():
    out, total, count = vlm_forward_step(_meta_model(), make_batch(), None, ONE_RANK, META)
    assert out.device == META and out.shape == () and count.device == META


def test_a_bad_host_batch_fails_before_the_copy_naming_the_sample():
    batch = make_batch()
    batch.tokens = batch.tokens.clone()
    batch.tokens[1, 0] = 5  # one image placeholder of sample s2 lost
    with pytest.raises(MediaPlaceholderError, match=r"^sample 's2' \(batch row 1\): 7 image placeholder.*2 image"):
        vlm_forward_step(_meta_model(), batch, None, ONE_RANK, META)
    batch = make_batch()
    batch.audio_counts = torch.tensor([0, 1])  # the clip is in row 0
    with pytest.raises(MediaPlaceholderError, match=r"^sample 's0,s1' \(batch row 0\): 2 audio placeholder"):
        vlm_forward_step(_meta_model(), batch, None, ONE_RANK, META)
    batch = make_batch()
    batch.images = batch.images[:3]
    with pytest.raises(MediaPlaceholderError, match="^image counts per row .* sum to 4 but the batch holds 3"):
        vlm_forward_step(_meta_model(), batch, None, ONE_RANK, META)


def test_splice_told_the_batch_was_checked_still_checks_cpu_tensors():
    batch = make_batch()
    tokens = batch.tokens.clone()
    tokens[1, 0] = 5
    feats = torch.zeros(int(batch.image_counts.sum()), 4, 8)
    with pytest.raises(MediaPlaceholderError, match=r"sample 's2' \(batch row 1\)"):
        splice_media(torch.zeros(2, 32, 8), tokens, IMAGE_ID, feats, batch.image_counts, "image", batch.__key__,
                     checked=True)


def test_host_check_and_splice_check_agree_on_good_batches():
    model = VLMModel(tiny_vlm_config(True))
    batch = make_batch()
    model.check_media_placeholders(batch.tokens, batch.image_counts, len(batch.images), batch.audio_counts,
                                   len(batch.audio), batch.__key__)  # no error
    checked = model.embed_inputs(batch.tokens, batch.images, batch.image_counts, batch.audio, batch.audio_lengths,
                                 batch.audio_counts, placeholders_checked=True)
    unchecked = model.embed_inputs(batch.tokens, batch.images, batch.image_counts, batch.audio, batch.audio_lengths,
                                   batch.audio_counts)
    assert torch.equal(checked, unchecked)


def test_the_serving_path_keeps_the_check():
    model = VLMModel(tiny_vlm_config(False))
    image = torch.zeros(1, 3, 16, 16)
    with pytest.raises(MediaPlaceholderError, match=r"batch row 0: 3 image placeholder"):
        vlm_prompt_embeds(model, [IMAGE_ID] * 3 + [7], image)
    assert vlm_prompt_embeds(model, [IMAGE_ID] * 4 + [7], image).shape == (5, 32)
