"""The VLM model on one device: splicing, shapes, config checks, freezing, overfitting a few captions."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config.loader import ConfigError
from mmtrain.config.vlm_schema import check_vlm_model
from mmtrain.model.audio import AudioEncoder, pool_valid_frames
from mmtrain.models.llama.model import GPTModel
from mmtrain.model.projector import pixel_shuffle
from mmtrain.model.vision import VisionEncoder, tile_image
from mmtrain.models.vlm import (
    MediaPlaceholderError,
    VLMModel,
    splice_media,
    unsplice_media,
)
from tests.vlm_helpers import AUDIO_ID, IMAGE_ID, make_batch, tiny_vlm_config


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread is fastest, and on a loaded machine several threads are many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(audio: bool = True, seed: int = 3, **kw) -> VLMModel:
    torch.manual_seed(0)
    model = VLMModel(tiny_vlm_config(audio, **kw))
    model.init_weights(seed)
    return model


def _media(batch) -> dict:
    return {"images": batch.images, "image_counts": batch.image_counts, "audio": batch.audio,
            "audio_lengths": batch.audio_lengths, "audio_counts": batch.audio_counts, "sample_keys": batch.__key__}


def test_splice_then_unsplice_gives_back_the_features_and_keeps_the_text():
    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 8, generator=g)
    feats = torch.randn(int(batch.image_counts.sum()), 4, 8, generator=g)
    out = splice_media(x, batch.tokens, IMAGE_ID, feats, batch.image_counts)
    assert torch.equal(unsplice_media(out, batch.tokens, IMAGE_ID, 4), feats)
    text = batch.tokens != IMAGE_ID
    assert torch.equal(out[text], x[text])
    # row-major placeholder order: row 0 holds images 0 and 1 (two packed samples), row 1 images 2 and 3
    assert torch.equal(out[1][batch.tokens[1] == IMAGE_ID].view(-1, 4, 8), feats[2:])


def test_placeholder_mismatch_names_the_sample():
    batch = make_batch()
    tokens = batch.tokens.clone()
    tokens[1, 0] = 5  # one image placeholder of sample s2 lost
    feats = torch.zeros(int(batch.image_counts.sum()), 4, 8)
    with pytest.raises(MediaPlaceholderError, match=r"sample 's2' \(batch row 1\): 7 image placeholder.*2 image"):
        splice_media(torch.zeros(2, 32, 8), tokens, IMAGE_ID, feats, batch.image_counts, "image", batch.__key__)
    with pytest.raises(MediaPlaceholderError, match="sum to 4 but the batch holds 3"):
        splice_media(torch.zeros(2, 32, 8), batch.tokens, IMAGE_ID, feats[:3], batch.image_counts)


def test_forward_returns_masked_token_losses_and_language_path_is_the_gpt():
    model = _model()
    batch = make_batch()
    losses = model(batch.tokens, batch.labels, batch.position_ids, batch.document_ids, **_media(batch))
    assert losses.shape == (2, 32)
    assert torch.all(losses[batch.labels == -100] == 0) and torch.all(losses[batch.labels != -100] > 0)
    # the language component is the GPT: same init, and inputs_embeds = embed(tokens) changes nothing
    gpt = GPTModel(model.cfg.language)
    gpt.init_weights(3)
    assert all(torch.equal(p, q) for p, q in zip(gpt.parameters(), model.language.parameters()))
    text = torch.randint(0, 56, (2, 12))
    assert torch.equal(gpt(text), gpt(None, inputs_embeds=gpt.embed(text)))


def test_vision_variants_audio_shapes_and_tiles():
    for kind in ("learned", "sincos2d", "rope2d"):
        enc = VisionEncoder(tiny_vlm_config(position_embedding=kind).vision)
        enc.init_weights(0)
        assert enc(torch.randn(3, 3, 16, 16), torch.tensor([0, 1, 2])).shape == (3, 16, 32)
    cfg = tiny_vlm_config().audio
    audio = AudioEncoder(cfg)
    audio.init_weights(0)
    out = audio(torch.randn(3, 2000), torch.tensor([2000, 900, 10]))
    assert out.shape == (3, cfg.num_tokens, cfg.hidden_size) and torch.isfinite(out).all()
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1).expand(2, 6, 2)
    pooled = pool_valid_frames(x, torch.tensor([4, 6]), 2)  # clip 0: frames 0-1 | 2-3; clip 1: 0-2 | 3-5
    assert pooled[:, :, 0].tolist() == [[0.5, 2.5], [7.0, 10.0]]
    tiles = tile_image(torch.rand(3, 20, 40), 16, 4)  # wide image -> 1x2 grid + thumbnail
    assert tiles.shape == (3, 3, 16, 16)
    assert tile_image(torch.rand(3, 20, 20), 16, 1).shape == (1, 3, 16, 16)


def test_a_full_length_default_clip_fits_the_default_audio_encoder():
    """Whisper's frame count (samples // hop): 30 s at 16 kHz is 3000 frames, 1500 positions = max_frames (the
    centred spectrogram's extra frame used to make it 1501 and the encoder refused the clip)."""
    from dataclasses import replace

    from mmtrain.config.media_schema import MediaConfig
    from mmtrain.config.vlm_schema import AudioConfig

    cfg = replace(AudioConfig(), hidden_size=8, num_layers=1, num_attention_heads=2, ffn_hidden_size=16)
    samples = int(MediaConfig().max_audio_seconds * cfg.sample_rate)
    audio = AudioEncoder(cfg)
    audio.init_weights(0)
    assert audio.log_mel(torch.randn(1, samples)).shape[-1] == samples // cfg.hop_length == 2 * cfg.max_frames
    assert audio(torch.randn(1, samples), torch.tensor([samples])).shape == (1, cfg.num_tokens, cfg.hidden_size)


def test_pixel_shuffle_merges_neighbouring_patches():
    grid = torch.arange(16, dtype=torch.float32).view(1, 16, 1)  # 4x4 grid, value = patch index
    out = pixel_shuffle(grid, 2)
    assert out.shape == (1, 4, 4)
    assert out[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_media_settings_are_derived_from_the_model():
    """One source of truth: the media path's image size, placeholder ids and counts, audio rate are the model's."""
    from mmtrain.config.media_schema import MediaConfig
    from mmtrain.data.multimodal_loader import settings_from_config

    cfg = tiny_vlm_config()
    assert cfg.tokens_per_image == 4 and cfg.tokens_per_audio == 2
    check_vlm_model(cfg)
    s = settings_from_config(MediaConfig(tokenizer="t.model", video_frames=3), cfg, seq_length=40)
    assert (s.image_size, s.num_image_tokens, s.image_token_id) == (16, 4, IMAGE_ID)
    assert (s.audio_token_id, s.num_audio_tokens, s.audio_rate) == (AUDIO_ID, 2, cfg.audio.sample_rate)
    assert (s.seq_length, s.video_frames, s.tokenizer) == (40, 3, "t.model")
    cfg.projector.pixel_shuffle = 1
    assert settings_from_config(MediaConfig(tokenizer="t.model"), cfg, 40).num_image_tokens == 16
    cfg.projector.pixel_shuffle, cfg.audio.enabled = 2, False
    assert settings_from_config(MediaConfig(tokenizer="t.model"), cfg, 40).audio_token_id is None  # audio refused


def test_config_checks_the_vlm_shape():
    cfg = tiny_vlm_config()
    with pytest.raises(ConfigError, match=r"vision.num_attention_heads \(4\) must be divisible by parallel.tp \(8"):
        check_vlm_model(cfg, tp=8)
    cfg.projector.pixel_shuffle = 3
    with pytest.raises(ConfigError, match="model.projector.pixel_shuffle"):
        check_vlm_model(cfg)


def _steps(model: VLMModel, batch, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        out = model(batch.tokens, batch.labels, batch.position_ids, batch.document_ids, **_media(batch))
        loss = (out * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_frozen_components_stay_bit_identical():
    model = _model()
    frozen = model.freeze(["vision", "language", "audio"])
    assert frozen and all(n.split(".")[0] in ("vision", "language", "audio") for n in frozen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _steps(model, make_batch(), 3, 1e-2)
    after = model.state_dict()
    for name, value in before.items():
        if name.startswith("projector"):
            assert not torch.equal(after[name], value), name
        else:
            assert torch.equal(after[name], value), name
    with pytest.raises(ValueError, match="not a VLM component"):
        model.freeze(["encoder"])


def test_overfitting_four_captions_drives_loss_near_zero_and_generate_recites_them():
    torch.manual_seed(0)
    model = _model(audio=False)
    g = torch.Generator().manual_seed(7)
    images = torch.randn(4, 3, 16, 16, generator=g)
    captions = [torch.randint(0, 56, (6,), generator=g).tolist() for _ in range(4)]
    tokens = torch.tensor([[IMAGE_ID] * 4 + c for c in captions])  # (4, 10): image then caption
    labels = torch.cat([tokens[:, 1:], torch.full((4, 1), 63)], dim=1)
    labels[:, :3] = -100
    batch = type("B", (), {})()
    batch.tokens, batch.labels, batch.loss_mask = tokens, labels, (labels != -100).float()
    batch.position_ids, batch.document_ids = torch.arange(10).expand(4, 10), torch.zeros(4, 10, dtype=torch.long)
    batch.images, batch.image_counts, batch.__key__ = images, torch.ones(4, dtype=torch.long), list("abcd")
    batch.audio = batch.audio_lengths = batch.audio_counts = None
    losses = _steps(model, batch, 150, 3e-3)
    assert losses[-1] < 0.05 < losses[0]
    for i in range(4):  # the image alone says which caption follows
        assert model.generate([IMAGE_ID] * 4, images[i:i + 1], max_new_tokens=7, eos_id=63) == captions[i] + [63]


def test_video_frames_get_their_temporal_rows_through_the_batch_path():
    """Two identical frames at different frame indices encode differently; the training step hands the batch's
    ``frame_index`` (aligned with ``images``, kept by ``concat_rows``) to the vision encoder."""
    from types import SimpleNamespace

    from mmtrain.data.media_batch import MediaBatch, concat_rows
    from mmtrain.train.build_vlm import vlm_forward_step

    model = _model(audio=False)
    frame = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    feats = model.encode_images(frame.expand(2, -1, -1, -1), torch.tensor([0, 1]))
    assert not torch.allclose(feats[0], feats[1])
    assert torch.allclose(model.encode_images(frame, torch.tensor([1]))[0], feats[1], atol=1e-6)

    still = MediaBatch.of(make_batch(audio=False))  # a caller without frame indices: every image a still
    assert still.frame_index.tolist() == [0, 0, 0, 0]
    video = MediaBatch.of(make_batch(audio=False))
    video.frame_index = torch.tensor([0, 0, 0, 1])  # row 1: two frames of one clip
    batch = concat_rows([video, still])
    assert batch.frame_index.tolist() == [0, 0, 0, 1, 0, 0, 0, 0] and batch.images.shape[0] == 8
    seen = []
    model.vision.register_forward_hook(lambda mod, args, out: seen.append(args[1].tolist()))
    mesh = SimpleNamespace(dims=SimpleNamespace(cp=1), coord=SimpleNamespace(cp=0))
    loss_video = vlm_forward_step(model, batch, None, mesh, torch.device("cpu"))[0]
    loss_still = vlm_forward_step(model, concat_rows([still, still]), None, mesh, torch.device("cpu"))[0]
    assert seen == [[0, 0, 0, 1, 0, 0, 0, 0], [0] * 8] and not torch.allclose(loss_video, loss_still)
