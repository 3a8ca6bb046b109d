"""A LLaVA imported from transformers (``init.*`` from its folder) split over two ranks gives transformers'
logits (fp32, < 1e-4): TP2 (tower and LM sharded by the GPT plan) and PP2 (tower on the first stage). CLIP +
Llama (untied, vision_feature_layer=-2, default strategy) and SigLIP + Qwen2 (tied); and a Whisper encoder
(init.audio) at TP2 gives transformers' features. One spawn for all."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from mmtrain.config.schema import ParallelConfig, TrainConfig  # noqa: E402
from mmtrain.convert.vlm_parts import load_vlm_parts  # noqa: E402
from mmtrain.models import llava_hf  # noqa: E402
from mmtrain.parallel import ParallelDims  # noqa: E402
from mmtrain.testing import run_distributed  # noqa: E402
from mmtrain.train.build_vlm import build_vlm_stage  # noqa: E402
from tests.unit.test_llava_hf import _prompt, make_llava  # noqa: E402

VARIANTS = {"clip-llama": ("clip", "llama", False, -2, "default"),
            "siglip-qwen2": ("siglip", "qwen2", True, -2, "full")}


def _run(rank: int, world_size: int, root: str) -> dict[str, float]:
    out = {}
    for variant in VARIANTS:
        folder = f"{root}/{variant}"
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
        model_cfg = llava_hf.vlm_config_from_llava(hf.config.to_dict())
        tokens = _prompt(model_cfg.tokens_per_image)
        images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = hf(input_ids=tokens, pixel_values=images).logits
        for layout in ({"tp": 2}, {"pp": 2}):
            pc = ParallelConfig(**layout)
            cfg = SimpleNamespace(model=model_cfg, parallel=pc, train=TrainConfig(precision="fp32"))
            mesh = ParallelDims.from_config(pc, world_size).build()
            stage = build_vlm_stage(cfg, mesh, torch.device("cpu")).eval()
            load_vlm_parts(stage, model_cfg, {p: folder for p in ("vision", "projector", "language")},
                           mesh.coord.tp, mesh.dims.tp)
            with torch.no_grad():
                if mesh.dims.pp == 1:
                    got = stage(tokens, images=images, image_counts=torch.tensor([1, 1]))
                elif mesh.coord.pp == 0:
                    dist.send(stage(tokens, images=images, image_counts=torch.tensor([1, 1])).contiguous(),
                              mesh.ranks("pp")[1])
                    got = None
                else:
                    hidden = torch.empty(*tokens.shape, model_cfg.language.hidden_size)
                    dist.recv(hidden, mesh.ranks("pp")[0])
                    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
                    got = stage(hidden, position_ids_BS=positions)
            if got is not None:
                out[f"{variant} {'tp2' if 'tp' in layout else 'pp2'} rank {rank}"] = float((got - want).abs().max())
    out.update(_whisper_tp2(rank, world_size, root))
    return out


def _whisper_tp2(rank: int, world_size: int, root: str) -> dict[str, float]:
    """A Whisper encoder loaded by init.audio into a TP2 VLM: the same features as transformers'."""
    from mmtrain.models.encoders_hf import audio_config_from_hf

    hf = transformers.WhisperModel.from_pretrained(f"{root}/whisper").eval()
    model_cfg = llava_hf.vlm_config_from_llava(
        transformers.LlavaForConditionalGeneration.from_pretrained(f"{root}/clip-llama").config.to_dict())
    model_cfg.audio = audio_config_from_hf(hf.config.to_dict())
    model_cfg.audio_token_id = 98
    pc = ParallelConfig(tp=2)
    cfg = SimpleNamespace(model=model_cfg, parallel=pc, train=TrainConfig(precision="fp32"))
    mesh = ParallelDims.from_config(pc, world_size).build()
    stage = build_vlm_stage(cfg, mesh, torch.device("cpu")).eval()
    load_vlm_parts(stage, model_cfg, {"audio": f"{root}/whisper"}, mesh.coord.tp, mesh.dims.tp)
    mel = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        d = (stage.audio.encode_log_mel(mel) - hf.encoder(mel).last_hidden_state).abs().max()
    return {f"whisper tp2 rank {rank}": float(d)}


def test_llava_logits_at_tp2_and_pp2(tmp_path):
    from tests.unit.test_vlm_hf_encoders import WHISPER

    for variant, args in VARIANTS.items():
        make_llava(*args).save_pretrained(tmp_path / variant)
    torch.manual_seed(7)
    transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)).save_pretrained(tmp_path / "whisper")
    results = {k: v for r in run_distributed(_run, 2, str(tmp_path)) for k, v in r.items()}
    assert len(results) == 2 * (2 + 1) + 2  # tp2: both ranks; pp2: the last stage; whisper tp2: both ranks
    assert all(d < 1e-4 for d in results.values()), results
