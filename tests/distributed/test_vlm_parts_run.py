"""A LLaVA-style run from pretrained parts: a SigLIP tower (HF folder) and a Llama LM (converted checkpoint) ->
stage 1 trains only the projector (tower and LM bit-identical to the sources after 20 steps) -> stage 2 from
stage 1's checkpoint -> export as LLaVA -> transformers loads it, equals our logits and generates a caption.
Also: the parts load at TP2 (same first loss), and an unlisted unused or missing tensor is an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmtrain.config import load_config  # noqa: E402
from mmtrain.config.vlm_run_schema import VLMRunConfig  # noqa: E402
from mmtrain.config.vlm_validate import validate_vlm_config  # noqa: E402
from mmtrain.convert.__main__ import main as convert  # noqa: E402
from mmtrain.models import encoders_hf  # noqa: E402
from mmtrain.models.llama.hf_adapter import model_config_from_hf  # noqa: E402
from mmtrain.parallel import ParallelDims  # noqa: E402
from mmtrain.testing import run_distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "tiny_cpu.yaml"
IMAGE_ID = 60
SMALL = ["data.mock=true", "data.seq_length=24", "train.micro_batch_size=2", "train.global_batch_size=4",
         "optim.warmup_steps=1", "optim.lr=1e-2", "model.audio.enabled=false", "logging.log_every=100",
         "checkpoint.keep_last=0", f"model.image_token_id={IMAGE_ID}", "model.projector.pixel_shuffle=1",
         "model.projector.input_norm=false", "media.video_frames=1"]


def _make_parts(root: Path) -> tuple[Path, Path]:
    """A random SigLIP tower saved by transformers and a random Llama converted to an mmtrain checkpoint."""
    torch.manual_seed(0)
    tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
        patch_size=4, vision_use_head=False))
    tower.save_pretrained(root / "siglip")
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64))
    lm.save_pretrained(root / "llama")
    assert convert(["hf-to-mmtrain", "--hf", str(root / "llama"), "--out", str(root / "llama_ck")]) == 0
    return root / "siglip", root / "llama_ck"


def _cfg(root: Path, run: str, extra: list[str]) -> VLMRunConfig:
    import json

    cfg = load_config(VLMRunConfig, CONFIG, [*SMALL, f"logging.run_dir={root / run}", *extra])
    cfg.model.vision = encoders_hf.vision_config_from_hf(json.loads((root / "siglip/config.json").read_text()),
                                                         feature_layer=-1)
    cfg.model.language = model_config_from_hf(json.loads((root / "llama/config.json").read_text()))
    cfg.model.projector.hidden_size = 0
    return cfg


def _train(rank: int, world_size: int, root: str, run: str, extra: list[str]):
    from mmtrain.train.vlm_train import train_vlm

    cfg = _cfg(Path(root), run, extra)
    validate_vlm_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    result = train_vlm(cfg, mesh, torch.device("cpu"))
    return result.losses, {k: v.clone() for k, v in result.model.state_dict().items()}


def _scenario(rank: int, world_size: int, root: str):
    root_p = Path(root)
    siglip, llama_ck = _make_parts(root_p)
    parts = [f"init.vision={siglip}", f"init.language={llama_ck}"]
    s1_losses, s1 = _train(rank, world_size, root, "s1", [*parts, "train.steps=20", "freeze=[vision, language]"])
    s2_losses, s2 = _train(rank, world_size, root, "s2", [f"init_from={root_p / 's1/checkpoints'}", "train.steps=2"])
    from mmtrain.convert.vlm_parts import load_vlm_parts
    from mmtrain.models.vlm import VLMModel

    errors = {}
    for name, layers, expect in (("unused", 1, {}), ("missing", 3, {}),
                                 ("listed", 1, {"expect_unused": ["vision.layers.1"]})):
        cfg = _cfg(root_p, "bad", [f"init.vision={siglip}"])
        cfg.model.vision.num_layers = layers  # the source has 2
        try:
            errors[name] = load_vlm_parts(VLMModel(cfg.model), cfg.model, cfg.init.sources(), **expect)
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            errors[name] = str(exc)
    return s1_losses, s1, s2_losses, s2, errors


def test_llava_recipe_from_pretrained_parts(tmp_path):
    s1_losses, s1, s2_losses, s2, errors = run_distributed(_scenario, 1, str(tmp_path))[0]
    tower = transformers.SiglipVisionModel.from_pretrained(str(tmp_path / "siglip"))
    lm = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "llama"))
    # stage 1: the tower and the LM are the sources' exact values after 20 steps; the projector learned
    assert torch.equal(s1["vision.layers.0.attn.qkv.weight"], torch.cat(
        [tower.state_dict()[f"encoder.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(s1["vision.pos_embed"], tower.state_dict()["embeddings.position_embedding.weight"])
    assert torch.equal(s1["language.embed.weight"], lm.state_dict()["model.embed_tokens.weight"])
    assert torch.equal(s1["language.output.weight"], lm.state_dict()["lm_head.weight"])
    assert len(s1_losses) == 20 and s1_losses[-1] < s1_losses[0]
    # stage 2 starts from stage 1 and trains everything
    assert not torch.equal(s2["language.embed.weight"], s1["language.embed.weight"])
    assert len(s2_losses) == 2
    assert "does not use" in errors["unused"] and "init.expect_unused" in errors["unused"]
    assert "lacks" in errors["missing"] and "vision.layers.2" in errors["missing"]
    assert "vision.layers.1.attn.qkv.weight" in errors["listed"]["parts"]["vision"]["unused"]
    assert errors["listed"]["initialised"] == ["projector", "language"]
    # export stage 2 as LLaVA: transformers loads it, equals our logits, and generates a caption
    ck, out = tmp_path / "s2" / "checkpoints", tmp_path / "llava"
    assert convert(["mmtrain-to-hf", "--ckpt", str(ck), "--out", str(out)]) == 0
    assert convert(["compare", "--hf", str(out), "--ckpt", str(ck)]) == 0
    llava = transformers.LlavaForConditionalGeneration.from_pretrained(str(out)).eval()
    pixels = transformers.AutoImageProcessor.from_pretrained(str(out))(
        images=[torch.zeros(3, 40, 30, dtype=torch.uint8)], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 16, 16)
    prompt = torch.tensor([[IMAGE_ID] * llava.config.image_seq_length + [5]])
    caption = llava.generate(input_ids=prompt, pixel_values=torch.randn(1, 3, 16, 16), max_new_tokens=4,
                             do_sample=False)
    assert caption.shape[1] == prompt.shape[1] + 4


def _first_loss(rank: int, world_size: int, root: str, tp: int):
    root_p = Path(root)
    if not (root_p / "llama_ck").exists():
        _make_parts(root_p)
    parts = [f"init.vision={root_p / 'siglip'}", f"init.language={root_p / 'llama_ck'}"]
    losses, _ = _train(rank, world_size, root, f"tp{tp}", [*parts, "train.steps=1", f"parallel.tp={tp}",
                                                          "checkpoint.save_final=false"])
    return losses


def test_parts_load_at_tp2(tmp_path):
    tp1 = run_distributed(_first_loss, 1, str(tmp_path), 1)[0]
    tp2 = run_distributed(_first_loss, 2, str(tmp_path), 2)[0]
    assert tp1 == pytest.approx(tp2, rel=1e-5)
