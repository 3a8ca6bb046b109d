"""LLaVA (CLIP or SigLIP tower, Llama or Qwen2 text) imported from random-init transformers models: the same
logits (fp32, < 1e-4) and exact round trips HF -> mmtrain -> HF."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmtrain.models.vlm import VLMModel  # noqa: E402
from mmtrain.models import llava_hf  # noqa: E402

TOL = 1e-4
IMAGE_TOKEN = 99


def make_llava(tower: str = "clip", text: str = "llama", tied: bool = False, layer: int = -2,
               strategy: str = "default", seed: int = 0):
    """A tiny random LlavaForConditionalGeneration (GQA LM, non-trivial norms)."""
    torch.manual_seed(seed)
    v = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
             patch_size=4)
    vision = (transformers.CLIPVisionConfig(**v) if tower == "clip"
              else transformers.SiglipVisionConfig(**v, vision_use_head=False))
    t = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    text_cfg = transformers.LlamaConfig(**t) if text == "llama" else transformers.Qwen2Config(**t)
    cfg = transformers.LlavaConfig(vision_config=vision.to_dict(), text_config=text_cfg.to_dict(),
                                   image_token_index=IMAGE_TOKEN, vision_feature_layer=layer,
                                   vision_feature_select_strategy=strategy, tie_word_embeddings=tied)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "class" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _prompt(n_image_tokens: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(batch):
        text = torch.randint(0, IMAGE_TOKEN, (7,), generator=g)
        rows.append(torch.cat([text[:3], torch.full((n_image_tokens,), IMAGE_TOKEN), text[3:]]))
    return torch.stack(rows)


def ours_from(hf_model):
    cfg = llava_hf.vlm_config_from_llava(hf_model.config.to_dict())
    full, skipped = llava_hf.vlm_state_from_llava(dict(hf_model.state_dict()), cfg)
    model = VLMModel(cfg).eval()
    model.load_state_dict({k: v for k, v in full.items()}, strict=not cfg.language.tie_embeddings)
    return model, cfg, full


CASES = [("clip", "llama", False, -2, "default"), ("siglip", "qwen2", True, -2, "default"),
         ("siglip", "llama", False, -1, "full"), ("clip", "qwen2", False, -1, "full")]


@pytest.mark.parametrize("tower,text,tied,layer,strategy", CASES)
def test_llava_logits_match(tower, text, tied, layer, strategy):
    hf = make_llava(tower, text, tied, layer, strategy)
    ours, cfg, _ = ours_from(hf)
    tokens = _prompt(cfg.tokens_per_image)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = hf(input_ids=tokens, pixel_values=images).logits
        got = ours(tokens, images=images, image_counts=torch.tensor([1, 1]))
    assert got.shape == want.shape
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("tower,text,tied,layer,strategy", CASES)
def test_llava_round_trip_exact(tower, text, tied, layer, strategy):
    hf = make_llava(tower, text, tied, layer, strategy)
    cfg = llava_hf.vlm_config_from_llava(hf.config.to_dict())
    full, _ = llava_hf.vlm_state_from_llava(dict(hf.state_dict()), cfg)
    back = llava_hf.llava_state_from_vlm(full, cfg)
    # the saved-checkpoint names; state_dict() names map onto them one to one
    again, _ = llava_hf.vlm_state_from_llava(back, cfg)
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith("position_ids")}
    if tied:
        theirs.pop("lm_head.weight")
    assert len(back) == len(theirs)
    assert sorted(v.sum().item() for v in back.values()) == sorted(v.sum().item() for v in theirs.values())
    hf_cfg = llava_hf.llava_config_from_vlm(cfg, hf.config.to_dict())
    assert llava_hf.vlm_config_from_llava(hf_cfg) == cfg
