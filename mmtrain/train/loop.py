"""The GPT training step loop: micro-batches -> forward/backward -> gradient reduction -> clip -> AdamW.

Losses are summed per token and divided by the global count of loss tokens after reduction, so any layout
(DP, gradient accumulation, masks) computes the same gradient as one process on the whole batch.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from mmtrain.config.schema import GPTRunConfig
from mmtrain.data.loader import MicroBatches
from mmtrain.model.gpt import GPTModel, flops_per_token
from mmtrain.parallel.data import allreduce_grads
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.train.lr import lr_at
from mmtrain.train.metrics import MetricsLogger
from mmtrain.train.optim import build_adamw
from mmtrain.utils.log import get_logger


def build_train_samples(cfg: GPTRunConfig):
    if cfg.data.mock:
        from mmtrain.data.mock import MockGPTSamples

        return MockGPTSamples(cfg.model.vocab_size, cfg.data.seq_length, cfg.data.seed)
    from mmtrain.data.gpt_dataset import build_gpt_samples_from_config

    return build_gpt_samples_from_config(cfg, split="train")


def autocast_for(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def global_batch_size(cfg: GPTRunConfig, dp: int) -> int:
    return cfg.train.global_batch_size or cfg.train.micro_batch_size * dp


def train_gpt(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device) -> list[float]:
    """Run ``cfg.train.steps`` optimizer steps; returns the loss of every step."""
    log = get_logger("train")
    dims = mesh.dims
    if dims.tp * dims.pp * dims.cp * dims.ep > 1:
        raise NotImplementedError("tensor, pipeline, context and expert parallelism arrive with the GPT engine issue")
    torch.manual_seed(cfg.train.seed)
    model = GPTModel(cfg.model)
    model.init_weights(cfg.train.seed)
    model.to(device)
    optimizer = build_adamw(model, cfg.optim)
    params = [p for p in model.parameters() if p.requires_grad]
    gbs = global_batch_size(cfg, dims.dp)
    num_micro = gbs // (cfg.train.micro_batch_size * dims.dp)
    batches = MicroBatches(build_train_samples(cfg), cfg.train.micro_batch_size, mesh.coord.dp, dims.dp)
    metrics = MetricsLogger(cfg.logging.run_dir, mesh.rank, cfg.train.steps, cfg.logging.log_every,
                            cfg.logging.tensorboard)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters; global batch {gbs} x "
             f"{cfg.data.seq_length} tokens = {num_micro} micro-batch(es) of {cfg.train.micro_batch_size} per rank")
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_length)
    losses = []
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.train.steps, cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        num_tokens = torch.zeros((), device=device, dtype=torch.float64)
        for _ in range(num_micro):
            tokens = batches.next().to(device, non_blocking=True)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with autocast_for(cfg.train.precision, device):
                token_losses = model(inputs, labels)
            micro_sum = token_losses.sum()
            micro_sum.backward()
            loss_sum += micro_sum.detach().double()
            num_tokens += labels.numel()
        stats = torch.stack([loss_sum, num_tokens])
        if dims.dp > 1:
            dist.all_reduce(stats, group=mesh.dp_group)
        allreduce_grads(params, mesh.dp_group, scale=1.0 / stats[1].item())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = (stats[0] / stats[1]).item()
        losses.append(loss)
        dt = time.perf_counter() - t0
        tokens_per_s = gbs * cfg.data.seq_length / dt / dims.world_size  # per device
        row = {"loss": loss, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_s,
               "tflops": tokens_per_s * flops_tok / 1e12, "step_time_s": dt}
        if cfg.logging.peak_tflops:
            row["mfu"] = row["tflops"] / cfg.logging.peak_tflops
        if device.type == "cuda":
            row["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics.log_step(step, row)
    metrics.close()
    return losses
