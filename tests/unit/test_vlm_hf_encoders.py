"""CLIP / SigLIP vision towers and the Whisper encoder imported from random-init transformers models: the same
features (fp32, < 1e-4) and exact round trips of the weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmtrain.model.audio import AudioEncoder  # noqa: E402
from mmtrain.model.vision import VisionEncoder  # noqa: E402
from mmtrain.models import encoders_hf as enc  # noqa: E402

TOL = 1e-4
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
              patch_size=4)


def _clip():
    torch.manual_seed(0)
    m = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION)).eval()
    with torch.no_grad():  # non-trivial norms and class token (random init leaves norms at 1/0)
        for n, p in m.named_parameters():
            if "norm" in n or "class" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _siglip():
    torch.manual_seed(1)
    m = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION, vision_use_head=False)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _ours_vision(hf_model, **kw):
    cfg = enc.vision_config_from_hf(hf_model.config.to_dict(), **kw)
    full, _ = enc.vision_state_from_hf(dict(hf_model.state_dict()), cfg)
    model = VisionEncoder(cfg).eval()
    model.load_state_dict(full, strict=True)
    return model, cfg, full


@pytest.mark.parametrize("make", [_clip, _siglip], ids=["clip", "siglip"])
def test_vision_tower_features_match(make):
    hf = make()
    ours, cfg, _ = _ours_vision(hf)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = hf(pixel_values=images).last_hidden_state
        got = ours(images)
    assert got.shape == want.shape  # CLIP: class token + 16 patches, SigLIP: 16 patches
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("make", [_clip, _siglip], ids=["clip", "siglip"])
@pytest.mark.parametrize("layer", [-1, -2])
def test_vision_feature_layer_and_drop_first(make, layer):
    hf = make()
    ours, cfg, _ = _ours_vision(hf, feature_layer=layer, drop_first_token=True)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = hf(pixel_values=images, output_hidden_states=True).hidden_states[layer][:, 1:]
        got = ours(images)
    assert got.shape == want.shape and got.shape[1] == cfg.num_features
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("make", [_clip, _siglip], ids=["clip", "siglip"])
def test_vision_round_trip_exact(make):
    hf = make()
    _, cfg, full = _ours_vision(hf)
    back = enc.vision_state_to_hf(full, cfg)
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith("position_ids")}
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    hf_cfg = enc.vision_config_to_hf(cfg)
    again = enc.vision_config_from_hf(hf_cfg)
    assert again == cfg


def test_siglip_head_is_left_out_and_reported():
    torch.manual_seed(2)
    hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION, vision_use_head=True))
    cfg = enc.vision_config_from_hf(hf.config.to_dict())
    full, skipped = enc.vision_state_from_hf(dict(hf.state_dict()), cfg)
    assert skipped and all(n.startswith("head.") for n in skipped)
    VisionEncoder(cfg).load_state_dict(full, strict=True)


def test_unmapped_vision_tensor_is_an_error():
    hf = _siglip()
    cfg = enc.vision_config_from_hf(hf.config.to_dict())
    tensors = dict(hf.state_dict())
    tensors["encoder.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(enc.EncoderHFError, match="extra"):
        enc.vision_state_from_hf(tensors, cfg)


WHISPER = dict(d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, vocab_size=60,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


@pytest.mark.parametrize("whole", [False, True], ids=["encoder", "whisper-model"])
def test_whisper_encoder_features_match(whole):
    pytest.importorskip("torchaudio")
    torch.manual_seed(3)
    config = transformers.WhisperConfig(**WHISPER)
    if whole:
        model = transformers.WhisperModel(config).eval()
        hf_enc, tensors = model.encoder, dict(model.state_dict())
    else:
        hf_enc = transformers.models.whisper.modeling_whisper.WhisperEncoder(config).eval()
        tensors = dict(hf_enc.state_dict())
    with torch.no_grad():
        for n, p in hf_enc.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    tensors = {k: v for k, v in (model.state_dict() if whole else hf_enc.state_dict()).items()}
    cfg = enc.audio_config_from_hf(config.to_dict())
    full, skipped = enc.audio_state_from_hf(tensors, cfg)
    assert bool(skipped) == whole and all(n.startswith("decoder.") for n in skipped)
    ours = AudioEncoder(cfg).eval()
    ours.load_state_dict(full, strict=True)
    mel = torch.randn(2, 8, 32)  # Whisper takes exactly 2 * max_source_positions feature frames
    with torch.no_grad():
        want = hf_enc(mel).last_hidden_state
        got = ours.encode_log_mel(mel)
    assert got.shape == want.shape
    assert (got - want).abs().max() < TOL
    back = enc.audio_state_to_hf(full, cfg)
    theirs = dict(hf_enc.state_dict())
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in theirs)
    assert enc.audio_config_from_hf(enc.audio_config_to_hf(cfg)) == cfg
