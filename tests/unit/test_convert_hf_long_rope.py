"""The HF bridge at long positions: mmtrain's RoPE equals transformers' bit for bit in fp32 (issue #16).

The frequencies are where the two can part: transformers computes the inverse frequencies (and the llama3
scaling) in float32, and at positions past a few thousand an ulp of an inverse frequency is a visible angle.
Realistic head sizes (64, 128) are used because at tiny ones (8) float64-then-cast happens to agree.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mmtrain.convert import hf_to_mmtrain  # noqa: E402
from mmtrain.convert.checkpoint_io import read_full_state  # noqa: E402
from mmtrain.models.llama.model import GPTModel  # noqa: E402
from mmtrain.model.layers import rope_frequencies  # noqa: E402

pytestmark = pytest.mark.unit

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
VOCAB = 64
SEQ = 32


def _tiny_hf(kind: str, head_dim: int, path, **overrides):
    """A one-layer random HF model with GQA (4 query heads, 2 key/value heads) of the given head size, saved to
    ``path``. q/k are scaled up so attention is sharp and a wrong rotation angle shows in the logits."""
    torch.manual_seed(0)
    shape = dict(hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16384, **overrides)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(path)
    return model.eval()


def _positions() -> torch.Tensor:
    """Row 0: a contiguous run past 8k (where llama3 scaling and float32 rounding both matter); row 1: increasing
    positions spread from 0 to ~12k (causal attention needs no contiguity, so one short row spans the range)."""
    far = torch.arange(SEQ) + 8300
    spread = torch.sort(torch.randperm(12_000, generator=torch.Generator().manual_seed(2))[:SEQ]).values
    return torch.stack([far, spread])


CASES = {
    "llama": ("llama", dict(rope_theta=500000.0)),
    "llama_llama3_scaling": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
    "qwen2_llama3_scaling": ("qwen2", dict(rope_theta=1e6, rope_scaling=LLAMA3_SCALING)),
    "mixtral": ("mixtral", dict(rope_theta=1e6)),
    "mixtral_llama3_scaling": ("mixtral", dict(rope_theta=1e6, rope_scaling=LLAMA3_SCALING)),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_past_8k_positions(case, head_dim, tmp_path):
    kind, overrides = CASES[case]
    hf_model = _tiny_hf(kind, head_dim, tmp_path / "hf", **overrides)
    full, cfg, _ = read_full_state(hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt"))
    ours = GPTModel(cfg)
    ours.load_state_dict(full, strict=True)
    assert torch.equal(ours.inv_freq, hf_model.model.rotary_emb.inv_freq)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = _positions()
    with torch.no_grad():
        theirs = hf_model(ids, position_ids=positions).logits
        mine = ours.eval()(ids, position_ids_BS=positions)
    assert (mine - theirs).abs().max().item() < 1e-4, (mine - theirs).abs().max().item()


@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])
@pytest.mark.parametrize("theta,factor", [(10000.0, 1.0), (500000.0, 1.0), (1e6, 1.0), (500000.0, 8.0),
                                          (500000.0, 32.0), (1e6, 16.0)])
def test_inverse_frequencies_equal_transformers(head_dim, theta, factor):
    rope = {"rope_type": "default", "rope_theta": theta} if factor == 1.0 else {
        **LLAMA3_SCALING, "factor": factor, "rope_theta": theta}
    config = transformers.LlamaConfig(hidden_size=head_dim, num_attention_heads=1, max_position_embeddings=16384,
                                      rope_parameters=rope)
    hf_model = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    assert torch.equal(rope_frequencies(head_dim, theta, factor), hf_model.inv_freq)
