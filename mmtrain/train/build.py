"""Build this rank's piece of the language model (the family ``model.family`` names, from
``mmtrain.models.registry``): its pipeline stage (or, with virtual stages, its chunks), initialized as the whole
model would be, then sharded over tensor/context/expert parallelism and moved to the device."""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.config.schema import GPTRunConfig, ParallelConfig
from mmtrain.model.attention_cp import attention_for
from mmtrain.models.registry import model_family
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.expert import apply_expert_parallel, expert_dispatch
from mmtrain.parallel.pipeline import stage_layer_ranges
from mmtrain.parallel.tensor import apply_tensor_parallel


class StageChunks(nn.Module):
    """A rank's virtual pipeline stages (chunks ``c`` = virtual stages ``c * pp + stage``), presented as one
    stage for what the trainer reads after the build (``mmtrain.models.contract.FamilyStage``: ``layers``,
    ``pre_process``, ``post_process``, ``sharding_spec()``; ``chunks`` for the interleaved schedule). Every
    parameter keeps its global name (the chunks' ``layers`` merged, their other submodules registered under their
    own names), so gradients, the optimizer and checkpoints need not care."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = chunks  # a plain list: the modules below register them under their global names
        self.pre_process, self.post_process = chunks[0].pre_process, chunks[-1].post_process
        merged: dict[str, nn.Module] = {}  # in the order the chunks hold them (the parameters' order)
        for chunk in chunks:
            for name, child in chunk.named_children():
                if name == "layers":
                    merged.setdefault(name, nn.ModuleDict()).update(child)
                elif name not in merged:
                    merged[name] = child
                elif next(child.parameters(), None) is not None:
                    raise ValueError(f"virtual pipeline chunks both hold {name!r} with parameters: their global "
                                     "names would clash (a family's stage keeps shared parts on one chunk)")
        for name, child in merged.items():
            self.add_module(name, child)

    def sharding_spec(self):
        """The whole model's spec (every chunk's is the same)."""
        return self.chunks[0].sharding_spec()


def moe_dispatch_for(parallel: ParallelConfig, mesh: ParallelMesh):
    """The MoE layers' token-dispatch strategy for this rank: over the mesh's EP group, the balance loss summed
    over the groups one micro-batch's tokens are split over (TP under sequence parallelism, CP)."""
    sp = parallel.sequence_parallel and mesh.dims.tp > 1
    return expert_dispatch(mesh.ep_group, token_groups=[mesh.tp_group if sp else None, mesh.cp_group],
                           padded=parallel.ep_dispatch == "padded", overlap_shared=parallel.ep_overlap_shared)


def _build_chunk(cfg: GPTRunConfig, mesh: ParallelMesh, layer_range: tuple[int, int], pre: bool, post: bool,
                 fp8_backend: str | None = None, init: bool = True) -> nn.Module:
    family = model_family(cfg.model)
    has_experts = family.has_routed_experts(cfg.model)
    lora = cfg.peft.lora if cfg.peft.lora.rank else None
    # the CP plan is the attention strategy the model is built with (K/V all-gather or ring, per-chunk masks)
    attention = attention_for(mesh.cp_group, cfg.train.document_attention, cfg.parallel.cp_comm)
    model = family.build_stage(cfg.model, layer_range, pre, post, attention,
                               moe_dispatch=moe_dispatch_for(cfg.parallel, mesh) if has_experts else None,
                               **({"lora": lora} if lora else {}))
    if init:
        model.init_weights(cfg.train.seed)
    apply_tensor_parallel(model, mesh.tp_group, cfg.parallel.sequence_parallel)
    if has_experts:
        apply_expert_parallel(model, mesh.ep_group)
    if fp8_backend is not None:
        from mmtrain.model.fp8 import apply_fp8  # FP8 runs only: its modules import torch._dynamo (~1 s)

        apply_fp8(model, cfg, mesh, fp8_backend)
    for block in model.layers.values():
        block.set_recompute(cfg.train.activation_checkpointing)
        if cfg.train.compile:
            # what stays eager around the block: TE's kernels (dynamo does not trace them), FSDP's hooks on its call
            block.compile_parts("no_linears" if fp8_backend == "te" else "inside_call" if cfg.parallel.fsdp
                                else "block")
    if cfg.train.compile and mesh.dims.tp == 1:  # under TP the vocab-parallel loss is its own autograd function
        model.compile_head()
    return model


def build_gpt_stage(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device) -> nn.Module:
    """This rank's model: its pipeline stage (or virtual-stage chunks) with whole-model initial values, sharded
    over tensor, context and expert parallelism per ``mesh``, FP8 linears for ``train.precision: fp8`` (then
    ``stage.fp8_runtime`` is set), with recompute/compile flags, on ``device``."""
    pp, stage, v = mesh.dims.pp, mesh.coord.pp, cfg.parallel.virtual_pp
    ranges = stage_layer_ranges(cfg.model.shape().num_layers, pp * v, cfg.parallel.pipeline_layers)
    fp8_backend = None
    if cfg.train.precision == "fp8":
        from mmtrain.model.fp8 import resolve_fp8_backend  # FP8 runs only: its modules import torch._dynamo

        fp8_backend = resolve_fp8_backend(cfg, device)
    chunks = []
    for c in range(v):
        vs = c * pp + stage
        chunks.append(_build_chunk(cfg, mesh, ranges[vs], pre=vs == 0, post=vs == pp * v - 1,
                                   fp8_backend=fp8_backend))
    if device.type == "cuda" and cfg.train.attention_backend != "auto":
        chosen = cfg.train.attention_backend
        torch.backends.cuda.enable_flash_sdp(chosen == "flash")
        torch.backends.cuda.enable_cudnn_sdp(chosen == "cudnn")
        torch.backends.cuda.enable_mem_efficient_sdp(chosen == "efficient")
        torch.backends.cuda.enable_math_sdp(chosen == "math")
    for chunk in chunks:
        chunk.to(device)
    built = chunks[0] if v == 1 else StageChunks(chunks)
    if fp8_backend is not None:  # the step loop's handle: weight re-casts and delayed-scaling updates
        from mmtrain.model.fp8 import Fp8Runtime

        built.fp8_runtime = Fp8Runtime(fp8_backend, cfg, chunks, mesh.tp_group)
    return built


def build_whole_model(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device,
                      param_dtype: torch.dtype | None = None) -> nn.Module:
    """The whole model of ``cfg`` (every layer, embedding and head) on this rank, whatever ``mesh``'s pipeline
    size, sharded over tensor, context and expert parallelism like a stage: a distillation teacher. Its weights
    are left as the layers' constructors made them (not ``init_weights``: the caller loads every one of them).
    ``param_dtype``: its parameters cast to it before they move to ``device`` (buffers keep their dtype)."""
    model = _build_chunk(cfg, mesh, (0, cfg.model.shape().num_layers), pre=True, post=True, init=False)
    for p in model.parameters() if param_dtype is not None else ():
        p.data = p.data.to(param_dtype)
    return model.to(device)
