"""Tensor-parallel generation: TP2 on gloo gives the same tokens as one process (greedy and seeded sampling),
from a checkpoint written at another layout; Llama (dense, MoE) and DeepSeek-V3 (MLA heads split, the latent
cache replicated, MoE routed in decode) and Nemotron-H (Mamba heads and groups split: each rank's recurrent state
holds its heads). Each both in step and one step ahead."""

from __future__ import annotations

import torch

from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.loading import load_checkpoint_model
from mmtrain.inference.sampling import SamplingParams
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from tests.inference_helpers import tiny_checkpoint, tiny_config, tiny_deepseek_config, tiny_nemotron_h_config

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57))]
PARAMS = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5)]


def _tokens(rank: int, world_size: int, ckpt: str) -> list[list[list[int]]]:
    model, _ = load_checkpoint_model(ckpt, ParallelDims(world_size, tp=world_size).build(), "cpu", torch.float32)
    # both schedules: in step (the CPU's default) and one step ahead (the GPU's)
    return [[s.token_ids for s in generate(DecodeEngine(model, 3, 64, overlap=ahead), PROMPTS, p)]
            for ahead in (False, True) for p in PARAMS]


def test_tp2_generates_the_tokens_of_one_process(tmp_path):
    for name, cfg in {"dense": tiny_config(), "moe": tiny_config(num_experts=4, tie_embeddings=True),
                      "deepseek_v3": tiny_deepseek_config(), "nemotron_h": tiny_nemotron_h_config()}.items():
        ckpt = str(tiny_checkpoint(tmp_path / name, cfg, tp=1))
        one = run_distributed(_tokens, 1, ckpt)[0]
        two = run_distributed(_tokens, 2, ckpt)
        assert two[0] == two[1] == one, name
        assert one[:2] == one[2:], name
