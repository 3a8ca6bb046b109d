"""Boxes of global tensors: every rank's shard (and any flat range of it) maps back onto the global tensor;
DCP round trips between layouts; checkpoint metadata that would unpickle code is refused."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.models.spec import ShardingSpec
from mmtrain.parallel.global_chunks import Shard, boxes, chunks_of, global_shape
from mmtrain.parallel.tensor import tp_shard_of
from mmtrain.utils.dcp_io import (
    CheckpointFormatError,
    load_chunks,
    read_metadata,
    save_chunks,
)

pytestmark = pytest.mark.unit

CFG = ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=8, vocab_size=32,
                  activation="swiglu")
# the dense model's spec plus the expert weights of the same shape with 4 experts
SPEC = ShardingSpec({**llama_sharding_spec(CFG), **{
    k: v for k, v in llama_sharding_spec(ModelConfig(**{**CFG.__dict__, "num_experts": 4, "moe_ffn_hidden_size": 3}))
    .items() if k.startswith("layers.0.mlp.experts.")}})
PARAMS = {  # global shapes
    "layers.0.attn.qkv.weight": (16 + 8 + 8, 16), "layers.0.mlp.up.weight": (16, 16),
    "layers.0.attn.proj.weight": (16, 16), "embed.weight": (32, 16), "layers.0.attn_norm.weight": (16,),
    "layers.0.mlp.experts.w_up": (4, 16, 6),
}


def _pieces(n: int, cuts: int, gen: torch.Generator) -> list[tuple[int, int]]:
    edges = sorted({0, n, *torch.randint(1, n, (cuts,), generator=gen).tolist()})
    return list(itertools.pairwise(edges))


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 2)])
def test_flat_pieces_of_every_shard_tile_the_global_tensor(name, tp, ep):
    gen = torch.Generator().manual_seed(tp * 10 + ep)
    full = torch.randn(PARAMS[name], generator=gen)
    rebuilt = torch.full_like(full, float("nan"))
    expert = name.endswith("w_up")
    for e in range(ep if expert else 1):
        for r in range(tp):
            local = tp_shard_of(name, full, SPEC, r, tp)
            if expert:
                local = local.chunk(ep)[e]
            shard = Shard(r, tp, e, ep if expert else 1)
            assert global_shape(name, tuple(local.shape), SPEC, shard) == tuple(full.shape)
            flat = local.reshape(-1)
            for lo, hi in _pieces(flat.numel(), 4, gen):  # distributed-optimizer-like flat ranges
                for b in boxes(name, tuple(local.shape), SPEC, shard, lo, hi):
                    region, values = b.of_global(rebuilt), b.of_flat(flat[lo:hi])
                    # a box is new, or a replica's (TP-replicated parameters): then it holds the same values
                    assert torch.isnan(region).all() or torch.equal(region, values), "boxes overlap"
                    region.copy_(values)
    assert torch.equal(rebuilt, full)


def test_dcp_round_trip_from_tp2_pieces_to_tp4_pieces(tmp_path):
    name = "layers.0.attn.qkv.weight"
    full = torch.randn(PARAMS[name])
    chunks = []
    for r in range(2):
        local = tp_shard_of(name, full, SPEC, r, 2).reshape(-1)
        for lo, hi in [(0, 37), (37, local.numel())]:
            chunks += chunks_of("w", name, (16, 16), local[lo:hi], SPEC, Shard(r, 2), lo, copy=torch.clone)
    save_chunks(tmp_path, chunks, no_dist=True)
    for r in range(4):
        local = torch.zeros(8, 16)
        flat = local.view(-1)
        load_chunks(tmp_path, [c for lo, hi in [(0, 5), (5, 128)]
                               for c in chunks_of("w", name, (8, 16), flat[lo:hi], SPEC, Shard(r, 4), lo)])
        assert torch.equal(local, tp_shard_of(name, full, SPEC, r, 4))
    with pytest.raises(CheckpointFormatError, match="no tensor 'v'"):
        load_chunks(tmp_path, chunks_of("v", name, (8, 16), torch.zeros(128), SPEC, Shard(0, 4)))


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointFormatError, match="refusing to load builtins.print"):
        read_metadata(tmp_path)
