"""``python -m mmtrain.convert`` on VLM parts: LLaVA / CLIP / SigLIP / Whisper folders saved by transformers ->
mmtrain checkpoints at TP/PP layouts -> back to HF (transformers loads the export and generates); ``compare``
exits 0 on a faithful conversion and 1 on a damaged one."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmtrain.convert.__main__ import main  # noqa: E402
from mmtrain.convert.vlm_convert import read_vlm_checkpoint  # noqa: E402
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from tests.unit.test_llava_hf import IMAGE_TOKEN, make_llava  # noqa: E402
from tests.unit.test_vlm_hf_encoders import WHISPER, _clip, _siglip  # noqa: E402


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], ["--tp", "2", "--pp", "2"]],
                         ids=["tp2", "pp2", "tp2pp2"])
def test_llava_cli_round_trip_and_generate(tmp_path, layout, capsys):
    hf = make_llava("siglip", "qwen2", tied=True)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), *layout]) == 0
    assert main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "vision features" in out and "projector" in out and "logits" in out
    assert main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    again = transformers.LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "back")).eval()
    n = again.config.image_seq_length
    prompt = torch.tensor([[1, 2] + [IMAGE_TOKEN] * n + [3]])
    gen = again.generate(input_ids=prompt, pixel_values=torch.randn(1, 3, 16, 16), max_new_tokens=3,
                         do_sample=False)
    assert gen.shape[1] == prompt.shape[1] + 3


def test_compare_exits_1_on_a_damaged_conversion(tmp_path):
    make_llava("clip", "llama").save_pretrained(tmp_path / "hf")
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    other = make_llava("clip", "llama", seed=1)
    other.save_pretrained(tmp_path / "other")
    assert main(["compare", "--hf", str(tmp_path / "other"), "--ckpt", str(tmp_path / "ck")]) == 1


@pytest.mark.parametrize("kind", ["clip", "siglip", "whisper"])
def test_tower_cli_round_trip(tmp_path, kind):
    if kind == "whisper":
        pytest.importorskip("torchaudio")
        torch.manual_seed(0)
        hf = transformers.WhisperModel(transformers.WhisperConfig(**WHISPER))
    else:
        hf = _clip() if kind == "clip" else _siglip()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), "--tp", "2"]) == 0
    full, cfg, meta, parts = read_vlm_checkpoint(tmp_path / "ck")
    assert parts == (["audio"] if kind == "whisper" else ["vision"])
    assert all(n.startswith(parts[0] + ".") for n in full)
    assert main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ck")]) == 0
    assert main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "back")
    if kind == "whisper":  # the encoder alone comes back
        original = {k.removeprefix("encoder."): v for k, v in original.items() if k.startswith("encoder.")}
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_init_audio_from_a_whisper_folder(tmp_path):
    """init.audio from a WhisperModel folder: the audio encoder equals Whisper's encoder on the same features; the
    decoder is reported as left out, the other components as initialised."""
    pytest.importorskip("torchaudio")
    from mmtrain.convert.vlm_parts import load_vlm_parts, report_lines
    from mmtrain.models.vlm import VLMModel
    from mmtrain.models.encoders_hf import audio_config_from_hf
    from tests.vlm_helpers import tiny_vlm_config

    torch.manual_seed(4)
    whisper = transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)).eval()
    whisper.save_pretrained(tmp_path / "whisper")
    cfg = tiny_vlm_config()
    cfg.audio = audio_config_from_hf(whisper.config.to_dict(), num_tokens=2)
    model = VLMModel(cfg).eval()
    model.init_weights(0)
    report = load_vlm_parts(model, cfg, {"audio": str(tmp_path / "whisper")})
    assert report["initialised"] == ["vision", "projector", "language"]
    assert report["parts"]["audio"]["left_out"] and not report["parts"]["audio"]["unused"]
    assert any("left out by the import" in line for line in report_lines(report))
    mel = torch.randn(1, 8, 32)
    with torch.no_grad():
        assert (model.audio.encode_log_mel(mel) - whisper.encoder(mel).last_hidden_state).abs().max() < 1e-4


def test_compare_on_a_language_model(tmp_path):
    torch.manual_seed(6)
    lm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300))
    lm.save_pretrained(tmp_path / "hf")
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), "--pp", "2"]) == 0
    assert main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ck"), "--text", "héllo"]) == 0


def _write_wav(path, seconds: float, rate: int, channels: int = 2) -> None:
    """A PCM-16 WAV of a chirp with noise (the standard library's writer: no codec needed)."""
    import wave

    t = torch.arange(int(seconds * rate)) / rate
    noise = torch.randn(len(t), generator=torch.Generator().manual_seed(0))
    x = 0.5 * torch.sin(2 * torch.pi * (200 + 600 * t) * t) + 0.05 * noise
    frames = (x.clamp(-1, 1) * 32767).to(torch.int16)[:, None].expand(-1, channels).contiguous()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames.numpy().tobytes())


def test_compare_with_an_audio_file_on_a_whisper_encoder(tmp_path, capsys):
    """``compare --audio FILE``: a stereo 8 kHz WAV (resampled to the encoder's rate, downmixed, cut or padded to
    its frames) through Whisper's encoder and ours: exit 0 and the audio features' diff; a changed encoder
    exits 1; a file that is no audio exits 2 with one line naming it."""
    pytest.importorskip("torchaudio")
    torch.manual_seed(0)
    transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)).save_pretrained(tmp_path / "hf")
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    for seconds in (0.05, 3.0):  # shorter and longer than the encoder's frames
        _write_wav(tmp_path / f"a{seconds}.wav", seconds, 8000)
        capsys.readouterr()
        assert main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ck"),
                     "--audio", str(tmp_path / f"a{seconds}.wav")]) == 0
        out = capsys.readouterr().out
        assert "audio features: max |diff| = " in out and out.strip().splitlines()[-1].startswith("OK: "), out
    torch.manual_seed(1)
    transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)).save_pretrained(tmp_path / "other")
    assert main(["compare", "--hf", str(tmp_path / "other"), "--ckpt", str(tmp_path / "ck"),
                 "--audio", str(tmp_path / "a3.0.wav")]) == 1
    assert "DIFFERENT: " in capsys.readouterr().out
    (tmp_path / "bad.wav").write_bytes(b"RIFF not really a wave file")
    assert main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "ck"),
                 "--audio", str(tmp_path / "bad.wav")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m mmtrain.convert compare: error: --audio ") and "bad.wav" in err
    assert "\n" not in err  # the file is read before any model is loaded
    make_llava("clip", "llama").save_pretrained(tmp_path / "llava")  # --audio on a model without audio: exit 2
    assert main(["compare", "--hf", str(tmp_path / "llava"), "--ckpt", str(tmp_path / "ck"),
                 "--audio", str(tmp_path / "a3.0.wav")]) == 2
    assert "--audio is for a Whisper encoder" in capsys.readouterr().err


@pytest.mark.parametrize("kind,section,change,message", [
    ("llava", "text_config", {"vocab_size": 10**12},
     "config.json: text_config.vocab_size=1000000000000, but the weights hold 100: model.embed_tokens.weight"),
    ("llava", "vision_config", {"intermediate_size": 10**9},
     "config.json: vision_config.intermediate_size=1000000000, but the weights hold 64: encoder.layers.0.mlp.fc1"),
    ("llava", "text_config", {"num_key_value_heads": 4},
     "config.json: text_config.num_key_value_heads=4 (x head_dim 12 = 48), but the weights hold 2"),
    ("clip", None, {"image_size": 32},
     "config.json: (image_size/patch_size)^2 + 1=65, but the weights hold 17: embeddings.position_embedding.weight"),
    ("clip", None, {"num_hidden_layers": -1}, "config.json: num_hidden_layers=-1 must be an integer >= 1"),
], ids=["llava_vocab", "llava_vision_ffn", "llava_kv_heads", "clip_image_size", "clip_negative_layers"])
def test_a_vlm_config_that_contradicts_its_weights_is_one_line(tmp_path, kind, section, change, message, capsys):
    import json

    (make_llava("clip", "llama") if kind == "llava" else _clip()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if section:
        config[section] = {**config[section], **change}
    else:
        config.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "ck").exists()
