"""Build this rank's piece of the GPT: its pipeline stage, initialized as the whole model would be, then
sharded over tensor parallelism and moved to the device."""

from __future__ import annotations

import torch

from mmtrain.config.schema import GPTRunConfig
from mmtrain.model.gpt import GPTModel, token_cross_entropy
from mmtrain.parallel.context import apply_context_parallel
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.expert import apply_expert_parallel
from mmtrain.parallel.pipeline import stage_layer_ranges
from mmtrain.parallel.tensor import apply_tensor_parallel


def build_gpt_stage(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device) -> GPTModel:
    pp, stage = mesh.dims.pp, mesh.coord.pp
    ranges = stage_layer_ranges(cfg.model.num_layers, pp, cfg.parallel.pipeline_layers)
    model = GPTModel(cfg.model, ranges[stage], pre_process=stage == 0, post_process=stage == pp - 1)
    model.init_weights(cfg.train.seed)
    apply_tensor_parallel(model, mesh.tp_group, cfg.parallel.sequence_parallel)
    apply_context_parallel(model, mesh.cp_group)
    if cfg.model.num_experts:
        sp = cfg.parallel.sequence_parallel and mesh.dims.tp > 1
        apply_expert_parallel(model, mesh.ep_group, sp, token_groups=[mesh.tp_group if sp else None, mesh.cp_group])
    mode = cfg.train.activation_checkpointing
    for block in model.layers.values():
        block.recompute = mode
        block.mlp.recompute_activation = mode == "selective"
        if cfg.train.compile:
            if cfg.model.num_experts:  # data-dependent token counts per expert: compile the dense parts only
                block.attn_norm.compile()
                block.attn.compile()
                block.mlp_norm.compile()
            else:
                block.compile()
    if cfg.train.compile and mesh.dims.tp == 1:  # fuses the fp32 upcast, log-softmax and its backward
        model.loss_fn = torch.compile(token_cross_entropy)
    if device.type == "cuda" and cfg.train.attention_backend != "auto":
        chosen = cfg.train.attention_backend
        torch.backends.cuda.enable_flash_sdp(chosen == "flash")
        torch.backends.cuda.enable_cudnn_sdp(chosen == "cudnn")
        torch.backends.cuda.enable_mem_efficient_sdp(chosen == "efficient")
        torch.backends.cuda.enable_math_sdp(chosen == "math")
    return model.to(device)
