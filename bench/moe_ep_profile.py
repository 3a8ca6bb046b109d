"""Where an MoE layer's time goes under expert parallelism: torch.profiler over forward + backward of a stack
of MoE layers (mmtrain.model.moe.MoELayer with the trainer's token dispatch), split into all-to-all, grouped
GEMM (the experts, SwiGLU included), router, shared experts, permute/unpermute (the sorts and row copies: argsort,
index_select / index_copy and their backward index_add, the padded buffer's cat) and the rest of the layer (the
weighted combine, the auxiliary loss). EP = the number of processes. ``--overlap`` overlaps the shared experts
with the dispatch all-to-all in forward and with the combine's reverse all-to-all in backward.

    python bench/moe_ep_profile.py                                   # 1 GPU, EP1
    torchrun --nproc_per_node 2 bench/moe_ep_profile.py              # 2 GPUs, EP2 (nccl)
    ... --dispatch padded --overlap --shared 4096                    # padded splits, shared expert overlapped
    python bench/moe_ep_profile.py --device cpu --tokens 64 --hidden 32 --ffn 32 --layers 2   # CPU check

How the split is measured: the router, the experts and the shared experts are modules; profiler ranges open
and close around each one's forward (forward hooks) and backward (full backward hooks), and around the whole
layer. The all-to-all is the NCCL / gloo kernels and ops by name (an all-to-all's time includes waiting for
the slowest rank). Permute/unpermute: the outermost index/sort ops by name (outside the router). Overlapped
phases each count their own device time; the wall time per iteration shows what the overlap saves. Times are device time
per iteration (CPU time with --device cpu: there the numbers only show that the script runs), plus the
wall time per iteration without the profiler. Default shape: the Megatron-Core anchor's MoE row
(../shared/bench/mcore_parallel_anchor.py: hidden 2048, 8 experts, top-2, expert FFN 4096, 4 x 4096 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config.schema import ModelConfig  # noqa: E402
from mmtrain.model.moe import MoELayer  # noqa: E402
from mmtrain.parallel.expert import apply_expert_parallel, expert_dispatch  # noqa: E402

PHASES = ("moe.layer", "moe.router", "moe.experts", "moe.shared")
A2A_KEYS = ("alltoall", "all_to_all", "sendrecv")
PERMUTE_OPS = {"aten::argsort", "aten::sort", "aten::index_select", "aten::index_copy", "aten::index_copy_",
               "aten::index_add", "aten::index_add_", "aten::cat", "aten::scatter", "aten::scatter_"}


def _inside(event, names: tuple[str, ...]) -> bool:
    """Whether a CPU event runs inside a range (or op) whose name starts with one of ``names``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(names):
            return True
        parent = parent.cpu_parent
    return False


class _Stack(nn.Module):
    """MoE layers only (each built with this rank's experts)."""

    def __init__(self, layers: list[MoELayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _ranged(module: nn.Module, name: str) -> None:
    """Profiler ranges around the module's forward and its backward."""
    enter, leave = torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit
    open_ranges: dict[str, list] = {"fwd": [], "bwd": []}
    module.register_forward_pre_hook(lambda m, a: open_ranges["fwd"].append(enter(name + ".fwd", None)))
    module.register_forward_hook(lambda m, a, o: leave(open_ranges["fwd"].pop()))
    module.register_full_backward_pre_hook(lambda m, g: open_ranges["bwd"].append(enter(name + ".bwd", None)))
    module.register_full_backward_hook(
        lambda m, gi, go: leave(open_ranges["bwd"].pop()) if open_ranges["bwd"] else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4 * 4096, help="tokens per rank and micro-batch")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=4096, help="expert FFN width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--shared", type=int, default=0, help="shared expert FFN width (0: none)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="profiled iterations (after 3 warm-up ones)")
    ap.add_argument("--dispatch", choices=("exact", "padded"), default="exact")
    ap.add_argument("--overlap", action="store_true", help="overlap the shared expert with the all-to-all")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    group = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        group = dist.group.WORLD
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = ModelConfig(hidden_size=a.hidden, ffn_hidden_size=a.ffn, moe_ffn_hidden_size=a.ffn, num_experts=a.experts,
                      moe_top_k=a.topk, moe_shared_ffn_hidden_size=a.shared, num_attention_heads=1,
                      activation="swiglu", add_bias=False, moe_aux_loss_coeff=1e-2)
    dispatch = expert_dispatch(group, padded=a.dispatch == "padded", overlap_shared=a.overlap)
    torch.manual_seed(0)
    stack = _Stack([MoELayer(cfg, dispatch) for _ in range(a.layers)])
    for p in stack.parameters():
        nn.init.normal_(p, std=0.02)
    apply_expert_parallel(stack, group)
    stack.to(device, dtype)
    for layer in stack.layers:
        _ranged(layer, "moe.layer")
        _ranged(layer.router, "moe.router")
        _ranged(layer.experts, "moe.experts")
        if layer.shared is not None:
            _ranged(layer.shared, "moe.shared")
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype, generator=None)

    def iteration():
        inp = x.detach().requires_grad_()
        stack(inp).float().square().mean().backward()

    for _ in range(3):
        iteration()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(a.steps):
            iteration()
        if cuda:
            torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()  # wall time without the profiler: what overlapping buys shows here
    for _ in range(a.steps):
        iteration()
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / a.steps
    totals = {p: 0.0 for p in PHASES}
    a2a = 0.0
    for e in prof.events():
        t = (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / a.steps  # ms per iteration
        base = e.name.rsplit(".", 1)[0]
        # the CPU-side range (the kernels launched inside it), not the GPU timeline's copy of the annotation
        if base in totals and e.name.endswith((".fwd", ".bwd")) and e.device_type == torch.autograd.DeviceType.CPU:
            totals[base] += t
        elif cuda and e.device_type == torch.autograd.DeviceType.CUDA and any(k in e.name.lower() for k in A2A_KEYS):
            a2a += t  # the NCCL kernels
    if not cuda:  # gloo runs the exchange inside the c10d ops: count the outermost one of each nesting
        a2a = sum(e.cpu_time_total for e in prof.events() if any(k in e.name.lower() for k in A2A_KEYS)
                  and not (e.cpu_parent and any(k in e.cpu_parent.name.lower() for k in A2A_KEYS))) / 1e3 / a.steps
    permute = sum((e.device_time_total if cuda else e.cpu_time_total) for e in prof.events()
                  if e.name in PERMUTE_OPS and e.device_type == torch.autograd.DeviceType.CPU
                  and _inside(e, ("moe.layer",)) and not _inside(e, ("moe.router", "moe.experts", "moe.shared",
                                                                        *PERMUTE_OPS))) / 1e3 / a.steps
    layer = totals["moe.layer"]
    rows = {"all-to-all": a2a, "grouped GEMM (experts)": totals["moe.experts"], "router": totals["moe.router"],
            "shared experts": totals["moe.shared"], "permute/unpermute": permute}
    rows["rest (combine, aux loss)"] = max(layer - sum(rows.values()), 0.0)
    if rank == 0:
        unit = "device" if cuda else "CPU"
        print(f"MoE x{a.layers}: {a.tokens} tokens/rank, hidden {a.hidden}, {a.experts} experts top-{a.topk}, "
              f"FFN {a.ffn}, shared {a.shared}, EP{world}, dispatch {a.dispatch}{' +overlap' if a.overlap else ''}")
        print(f"{'phase':28s} {unit + ' ms/iter':>14s} {'% of MoE':>9s}")
        for name, ms in rows.items():
            print(f"{name:28s} {ms:14.2f} {100 * ms / layer if layer else 0:8.1f}%")
        print(f"{'MoE layers total':28s} {layer:14.2f} {100.0:8.1f}%")
        print(f"wall ms/iter (fwd+bwd, no profiler): {wall_ms:.2f}; {a.tokens * world / wall_ms * 1e3:,.0f} tokens/s "
              "over all ranks (phases that overlap each count their own device time above)")
        print(json.dumps({"bench": "moe_ep_profile", "ep": world, "dispatch": a.dispatch, "overlap": a.overlap,
                          "tokens": a.tokens, "shared": a.shared, "ms_per_iter": round(layer, 3),
                          "wall_ms_per_iter": round(wall_ms, 3),
                          **{k: round(v, 3) for k, v in rows.items()}}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
