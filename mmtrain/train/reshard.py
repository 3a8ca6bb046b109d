"""Resume a training checkpoint at another parallel layout (TP, PP, DP, CP, EP sizes).

Weights go through the Hugging Face bridge's merge/split (``load_model_weights``: full tensors from the saved
shards, this rank's shard of them). The optimizer state follows the same path: every saved rank lists its
optimizer pieces as (parameter name, flat range of that rank's parameter shard) with the piece's fp32 master
and Adam moments; pieces are laid back into parameter-shard-shaped tensors per saved (tp, pp, ep) coordinate,
merged to full tensors exactly like weights, and cut again for this rank's own pieces. The loader resumes from
the global sample count, which means the same thing at any data-parallel size. RNG streams are per rank and do
not carry over (the models have no dropout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmtrain.convert.checkpoint_io import EXPERT_PARAMS, _full_tensor_for, merge_shards, read_checkpoint_meta
from mmtrain.parallel.dims import ParallelDims, ParallelMesh
from mmtrain.parallel.tensor import tp_shard_of

KINDS = ("master", "exp_avg", "exp_avg_sq")


def piece_records(model: torch.nn.Module, optimizer: Any) -> list[list]:
    """[name, lo, hi] per optimizer piece: the flat range of this rank's shard of parameter ``name``."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(pc.param)], pc.start - pc.param.buffer_offset, pc.end - pc.param.buffer_offset]
            for pc in optimizer.pieces]


def piece_states(optimizer: Any, host) -> list[dict]:
    """The AdamW state of every piece (empty before the first step), through ``host`` (a copy-to-CPU)."""
    out = []
    for pc in optimizer.pieces:
        st = optimizer.optimizer.state.get(pc.master, {})
        out.append({k: host(v) for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _full_optimizer_tensors(folder: Path, cfg) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """{kind: {parameter name: full tensor}} and the Adam step count, from every saved rank's pieces."""
    meta = json.loads((folder / "complete.json").read_text())
    lay = meta["layout"]
    saved = ParallelDims(world_size=lay["world_size"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], dp=lay["dp"],
                         ep=lay["ep"])
    flat: dict[tuple, torch.Tensor] = {}
    shapes: dict[tuple, torch.Size] = {}
    step = 0.0
    for rank in range(saved.world_size):
        state = torch.load(folder / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
        if "pieces" not in state:
            raise ValueError(f"{folder} predates resharding support (no optimizer piece records)")
        c = saved.coord(rank)
        masters = state["optimizer_masters"]
        for i, (name, lo, hi) in enumerate(state["pieces"]):
            ep = c.ep if name.endswith(EXPERT_PARAMS) else 0
            shape = state["model"][name].shape
            for kind in KINDS:
                value = masters[i] if kind == "master" and masters else state["piece_state"][i].get(kind)
                if kind == "master" and value is None:
                    value = state["model"][name].reshape(-1)[lo:hi].float()  # no fp32 masters: the weights
                if value is None:
                    continue
                key = (kind, c.tp, c.pp, ep, name)
                buf = flat.setdefault(key, torch.zeros(shape.numel(), dtype=torch.float32))
                shapes[key] = shape
                buf[lo:hi] = value.float()
            if "step" in state["piece_state"][i]:
                step = max(step, float(state["piece_state"][i]["step"]))
    full: dict[str, dict[str, torch.Tensor]] = {}
    for kind in KINDS:
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (k, tp, pp, ep, name), buf in sorted(flat.items(), key=lambda kv: kv[0][1:]):
            if k != kind:
                continue
            shards.setdefault((tp, pp), {}).setdefault(name, []).append(buf.view(shapes[(k, tp, pp, ep, name)]))
        if shards:
            joined = {key: {n: torch.cat(v) if len(v) > 1 else v[0] for n, v in d.items()} for key, d in shards.items()}
            full[kind] = merge_shards(joined, cfg)
    return full, step


@torch.no_grad()
def reshard_optimizer(folder: Path, mesh: ParallelMesh, model: torch.nn.Module, optimizer: Any) -> None:
    """Fill this rank's optimizer pieces (fp32 masters, Adam moments, step) from a checkpoint of any layout."""
    _, cfg, _ = read_checkpoint_meta(folder)
    full, step = _full_optimizer_tensors(folder, cfg)
    fused = bool(optimizer.optimizer.defaults.get("fused"))
    for (name, lo, hi), pc in zip(piece_records(model, optimizer), optimizer.pieces):
        def mine(kind: str) -> torch.Tensor:
            value = tp_shard_of(name, _full_tensor_for(name, full[kind], cfg), cfg, mesh.coord.tp, mesh.dims.tp)
            if name.endswith(EXPERT_PARAMS) and mesh.dims.ep > 1:
                value = value.chunk(mesh.dims.ep)[mesh.coord.ep]
            return value.reshape(-1)[lo:hi].to(pc.master.device)

        if optimizer.master_weights:
            pc.master.copy_(mine("master"))
        if "exp_avg" in full:
            optimizer.optimizer.state[pc.master] = {
                "step": torch.tensor(step, dtype=torch.float32, device=pc.master.device if fused else "cpu"),
                "exp_avg": mine("exp_avg").to(pc.master.dtype), "exp_avg_sq": mine("exp_avg_sq").to(pc.master.dtype)}
