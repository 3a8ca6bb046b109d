"""The GPT training step loop: micro-batches -> forward/backward (1F1B across stages) -> gradient
finalization -> clip -> AdamW, with one metrics line per step.

Losses are summed per token and gradients divided by the global count of loss tokens after reduction, so any
layout (TP, PP, DP, gradient accumulation, masks) computes the same update as one process on the whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mmtrain.config.schema import GPTRunConfig
from mmtrain.data.loader import MicroBatches
from mmtrain.model.gpt import GPTModel, flops_per_token
from mmtrain.parallel.data import GradBuckets, MixedPrecisionAdamW
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.pipeline import PipelineComm, one_f_one_b
from mmtrain.train.build import build_gpt_stage
from mmtrain.train.grads import clip_grad_norm, finalize_grads, tied_embedding_params
from mmtrain.train.lr import lr_at
from mmtrain.train.metrics import MetricsLogger
from mmtrain.utils.log import get_logger


def build_train_samples(cfg: GPTRunConfig):
    if cfg.data.mock:
        from mmtrain.data.mock import MockGPTSamples

        return MockGPTSamples(cfg.model.vocab_size, cfg.data.seq_length, cfg.data.seed)
    from mmtrain.data.gpt_dataset import build_gpt_samples_from_config

    return build_gpt_samples_from_config(cfg, split="train")


def param_dtype_for(precision: str) -> torch.dtype:
    """Model weights (and activations) are bf16 for bf16/fp8 runs; fp32 master copies live in the optimizer."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def global_batch_size(cfg: GPTRunConfig, dp: int) -> int:
    return cfg.train.global_batch_size or cfg.train.micro_batch_size * dp


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    model: GPTModel | None = None


def forward_backward(stage: GPTModel, micro_batches: list[torch.Tensor], mesh: ParallelMesh, cfg: GPTRunConfig,
                     device: torch.device, buckets: GradBuckets) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this step's micro-batches; returns (sum of token losses, loss tokens) as seen
    by this rank (non-zero on the last pipeline stage only)."""
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    num_tokens = torch.zeros((), device=device, dtype=torch.float64)

    def forward_step(i: int, received: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_sum, num_tokens
        tokens = micro_batches[i].to(device, non_blocking=True)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        B, S = inputs.shape
        positions = torch.arange(S, device=device).expand(B, S)
        out = stage(inputs if stage.pre_process else received, labels if stage.post_process else None, positions)
        if not stage.post_process:
            return out
        total = out.sum()
        loss_sum += total.detach().double()
        num_tokens += labels.numel()
        return total

    if mesh.dims.pp == 1:
        for i in range(len(micro_batches)):
            loss = forward_step(i, None)
            if i == len(micro_batches) - 1:
                buckets.last_backward()
            loss.backward()
        return loss_sum, num_tokens
    pp_ranks = mesh.ranks("pp")
    s = mesh.coord.pp
    mbs, S = micro_batches[0].shape[0], micro_batches[0].shape[1] - 1
    seq = S // mesh.dims.tp if cfg.parallel.sequence_parallel else S
    comm = PipelineComm(mesh.pp_group, pp_ranks[s - 1] if s > 0 else None,
                        pp_ranks[s + 1] if s < len(pp_ranks) - 1 else None,
                        (mbs, seq, cfg.model.hidden_size), param_dtype_for(cfg.train.precision), device)
    one_f_one_b(forward_step, len(micro_batches), comm, s, mesh.dims.pp, before_last_backward=buckets.last_backward)
    return loss_sum, num_tokens


def train_gpt(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps on this rank's stage/shard of the model."""
    log = get_logger("train")
    dims = mesh.dims
    if dims.cp > 1 or dims.ep > 1:
        raise NotImplementedError("context and expert parallelism arrive with the long-context/MoE issue")
    torch.manual_seed(cfg.train.seed)
    stage = build_gpt_stage(cfg, mesh, device)
    params = [p for p in stage.parameters() if p.requires_grad]
    o = cfg.optim
    pdtype = param_dtype_for(cfg.train.precision)
    buckets = GradBuckets(params, mesh.dp_cp_group, cfg.parallel.distributed_optimizer, pdtype,
                          late_params=tied_embedding_params(stage),
                          grad_dtype=torch.float32 if o.master_weights else pdtype)
    optimizer = MixedPrecisionAdamW(buckets, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.master_weights)
    gbs = global_batch_size(cfg, dims.dp)
    num_micro = gbs // (cfg.train.micro_batch_size * dims.dp)
    batches = MicroBatches(build_train_samples(cfg), cfg.train.micro_batch_size, mesh.coord.dp, dims.dp)
    metrics = MetricsLogger(cfg.logging.run_dir, mesh.rank, cfg.train.steps, cfg.logging.log_every,
                            cfg.logging.tensorboard)
    n_params = sum(p.numel() for p in stage.parameters())
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters on this rank; global batch {gbs} x "
             f"{cfg.data.seq_length} tokens = {num_micro} micro-batch(es) of {cfg.train.micro_batch_size} per DP rank")
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_length)
    result = TrainResult(model=stage)
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.train.steps, cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [batches.next() for _ in range(num_micro)]
        buckets.reset()
        loss_sum, num_tokens = forward_backward(stage, micro_batches, mesh, cfg, device, buckets)
        stats = torch.stack([loss_sum, num_tokens])
        if dims.dp * dims.cp > 1:
            dist.all_reduce(stats, group=mesh.dp_cp_group)
        if dims.pp > 1:  # only the last stage holds losses: share them with the other stages
            dist.all_reduce(stats, group=mesh.pp_group)
        finalize_grads(stage, mesh, buckets, optimizer, stats[1].item())
        grad_norm = clip_grad_norm(stage, mesh, buckets, optimizer, cfg.optim.grad_clip)
        optimizer.step()
        loss = (stats[0] / stats[1]).item()
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        dt = time.perf_counter() - t0  # .item() calls above synchronize with the device
        result.step_times.append(dt)
        tokens_per_s = gbs * cfg.data.seq_length / dt / dims.world_size  # per device
        row = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "tflops": tokens_per_s * flops_tok / 1e12, "step_time_s": dt}
        if cfg.logging.peak_tflops:
            row["mfu"] = row["tflops"] / cfg.logging.peak_tflops
        if device.type == "cuda":
            row["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics.log_step(step, row)
    metrics.close()
    return result
