"""The GPT training step loop: micro-batches -> forward/backward (1F1B across stages) -> gradient
finalization -> clip -> AdamW, with one metrics line per step, periodic evaluation and checkpoints.

Losses are summed per token and gradients divided by the global count of loss tokens after reduction, so any
layout (TP, PP, DP, gradient accumulation, masks) computes the same update as one process on the whole batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mmtrain.config.schema import GPTRunConfig
from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.data.documents import DocumentRule, GPTMicroBatch
from mmtrain.data.grpo_prompts import build_prompt_order
from mmtrain.data.loader import MicroBatches
from mmtrain.data.preference_dataset import build_preference_pairs_from_config
from mmtrain.data.sft_dataset import build_sft_samples_from_config, sft_micro_batch
from mmtrain.models.registry import model_family
from mmtrain.parallel.context import shard_sequence
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.grad_buckets import GradBuckets
from mmtrain.parallel.pipeline import PipelineComm, forward_only, interleaved_schedule, one_f_one_b
from mmtrain.train.build import build_gpt_stage
from mmtrain.train.dpo import build_reference, dpo_metrics, run_dpo_micro_batches
from mmtrain.train.grpo import grpo_step, reference_config
from mmtrain.train.distill import distill_task
from mmtrain.train.checkpoint import (CheckpointError, CheckpointWriter, find_checkpoint, is_weights_only,
                                      load_checkpoint)
from mmtrain.train.fsdp_setup import fully_sharded_buckets, fully_sharded_frozen
from mmtrain.train.faults import (CollectiveTimeout, NonFiniteError, collective_timeout_report, is_collective_timeout,
                                  nonfinite_report)
from mmtrain.train.grads import clip_grad_norm, finalize_grads, split_by_reduce_group, tied_embedding_params
from mmtrain.train.metrics import MetricsLogger
from mmtrain.train.optimizer import MixedPrecisionAdamW
from mmtrain.train.precision import precision_for
from mmtrain.train.resume_inputs import LrSchedule, resolve_resume, resume_records
from mmtrain.train.samples import SampleLogger
from mmtrain.train.step_hooks import PreemptionCheck, RouterBiasBalancer, StepHooks
from mmtrain.train.step_readout import PendingStep, StepClock, queue_readout
from mmtrain.train.wandb_sink import WandbSink
from mmtrain.utils.log import get_logger


def _build_samples(cfg: GPTRunConfig, split: str, dp_size: int, index_builder: bool):
    if cfg.train.objective == "grpo":  # prompts, completed by the policy in the step
        return build_prompt_order(cfg, dp_size)
    if cfg.data.type == "sft":
        return build_sft_samples_from_config(cfg, split, dp_size)
    if cfg.data.type == "preference":
        return build_preference_pairs_from_config(cfg, split, dp_size)
    if cfg.data.mock:
        from mmtrain.data.mock import MockGPTSamples

        seed = cfg.data.seed + {"train": 0, "valid": 1, "test": 2}[split]
        return MockGPTSamples(cfg.model.shape().vocab_size, cfg.data.seq_length, seed)
    from mmtrain.data.blend import build_gpt_samples_from_config

    return build_gpt_samples_from_config(cfg, split, dp_size, index_builder=index_builder)


def _param_dtype_for(precision: str) -> torch.dtype:
    """Model weights (and activations) are bf16 unless the run is fp32; fp32 master copies live in the optimizer."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


@torch.no_grad()
def cast_frozen_params(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters (a LoRA base, frozen VLM parts, the DPO reference) in the run's weight
    dtype: the gradient buckets put the trainable ones there, and a bf16 run that left the frozen ones fp32
    would feed fp32 weights bf16 activations (and keep twice the bytes)."""
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def global_batch_size(cfg: GPTRunConfig, dp: int) -> int:
    return cfg.train.global_batch_size or cfg.train.micro_batch_size * dp


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    preempted: bool = False
    model: torch.nn.Module | None = None
    optimizer: MixedPrecisionAdamW | None = None


def run_micro_batches(stage: torch.nn.Module, micro_batches: list, mesh: ParallelMesh, cfg: GPTRunConfig,
                      device: torch.device, buckets: list[GradBuckets] | None,
                      row_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Forward (and backward when ``buckets`` is given) over micro-batches (``GPTMicroBatch``es, or plain
    (B, S + 1) token tensors); returns [sum of token losses, loss tokens] as seen by this rank (non-zero on the
    last pipeline stage only). Packed documents' positions, document ids and loss mask come with the
    micro-batch (the loader made them); the model's attention strategy turns the ids into its mask.
    ``row_masks``: per micro-batch, a (mbs,) 0/1 tensor; rows with 0 count no loss (an evaluation pads its last
    batch so every rank runs the same shapes)."""
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    cp, cp_rank = mesh.dims.cp, mesh.coord.cp
    # SFT samples arrive as (B, 4, S + 1) rows (tokens, loss mask, conversations, positions)
    micro_batches = [b if isinstance(b, GPTMicroBatch) else sft_micro_batch(b) if b.ndim == 3
                     else GPTMicroBatch.plain(b) for b in micro_batches]

    def forward_step(i: int, received: torch.Tensor | None, module: torch.nn.Module = stage) -> torch.Tensor:
        batch = micro_batches[i].to(device)
        inputs, labels = batch.tokens[:, :-1], batch.tokens[:, 1:]
        loss_mask = batch.loss_mask
        if row_masks is not None:
            B, S = labels.shape
            rows = row_masks[i].to(device=device, dtype=torch.float32)[:, None].expand(B, S)
            loss_mask = rows if loss_mask is None else loss_mask * rows
        # context parallelism: this rank's two zig-zag chunks of every per-token tensor
        inputs, labels, positions, doc_ids, loss_mask = (
            None if t is None else shard_sequence(t, cp, cp_rank)
            for t in (inputs, labels, batch.position_ids, batch.document_ids, loss_mask))
        out = module(inputs if module.pre_process else received, labels if module.post_process else None, positions,
                     doc_ids)
        if not module.post_process:
            return out
        if loss_mask is not None:
            total = (out * loss_mask).sum()
            stats[1] += loss_mask.sum().double()
        else:
            total = out.sum()
            stats[1] += labels.numel()
        stats[0] += total.detach().double()
        return total

    mbs, S = micro_batches[0].tokens.shape[0], micro_batches[0].tokens.shape[1] - 1
    schedule_micro_batches(forward_step, len(micro_batches), stage, mesh, cfg, device, buckets,
                           (mbs, S, cfg.model.shape().hidden_size))
    return stats


def schedule_micro_batches(forward_step, num_micro: int, stage, mesh: ParallelMesh, cfg, device: torch.device,
                           buckets: list[GradBuckets] | None, shape_BSD: tuple[int, int, int]) -> None:
    """Run ``forward_step(i, received, module) -> loss or activations`` over the micro-batches: in order with one
    stage, else with the pipeline schedule (1F1B, interleaved, or forward only when ``buckets`` is None); the
    buckets start reducing before the last backward. ``shape_BSD``: a micro-batch's (batch, whole sequence,
    hidden) -- what flows between stages is this rank's part of the sequence."""
    pp, s = mesh.dims.pp, mesh.coord.pp
    if pp == 1:
        for i in range(num_micro):
            loss = forward_step(i, None, stage)
            if buckets is not None:
                if i == num_micro - 1:
                    for b in buckets:
                        b.last_backward()
                loss.backward()
        return
    ranks = mesh.ranks("pp")
    mbs, S, hidden = shape_BSD
    seq = S // mesh.dims.cp // (mesh.dims.tp if cfg.parallel.sequence_parallel else 1)
    shape, dtype = (mbs, seq, hidden), _param_dtype_for(cfg.train.precision)
    if cfg.parallel.virtual_pp > 1:
        interleaved_schedule(lambda c, i, x: forward_step(i, x, stage.chunks[c]), num_micro, mesh.pp_group,
                             ranks, s, cfg.parallel.virtual_pp, shape, dtype, device, backward=buckets is not None,
                             before_last_backward=lambda: [b.last_backward() for b in buckets or []])
        return

    def step(i: int, x):
        return forward_step(i, x, stage)

    comm = PipelineComm(mesh.pp_group, ranks[s - 1] if s > 0 else None, ranks[s + 1] if s < pp - 1 else None,
                        shape, dtype, device)
    if buckets is None:
        forward_only(step, num_micro, comm)
    else:
        one_f_one_b(step, num_micro, comm, s, pp, before_last_backward=lambda: [b.last_backward() for b in buckets])


def reduce_loss_stats(stats: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """Sum (loss, tokens) over data/context ranks, then share the last stage's numbers with every stage."""
    if mesh.dims.dp * mesh.dims.cp > 1:
        dist.all_reduce(stats, group=mesh.dp_cp_group)
    if mesh.dims.pp > 1:
        dist.all_reduce(stats, group=mesh.pp_group)
    return stats


@dataclass
class StepTask:
    """What a model family plugs into the shared step loop (``train_gpt`` builds the GPT one).

    ``forward_backward(micro_batches, buckets)``: forward (and backward unless ``buckets`` is None) over this
    rank's micro-batches, returning its stats ``[loss sum, loss tokens, *extra counts]`` (float64; summed over
    data-parallel ranks by the loop). ``step_flops(stats)``: model FLOPs (forward + backward) of the whole global
    step from the reduced stats. ``extra_metrics(stats, dt)``: more metrics for the step line (e.g. images/s).
    ``routed_experts``: the (language) model has MoE layers whose router biases the loop balances each step."""

    forward_backward: Callable[[list, list | None], torch.Tensor]
    step_flops: Callable[[torch.Tensor], float]
    extra_metrics: Callable[[torch.Tensor, float], dict] = lambda stats, dt: {}
    routed_experts: bool = False


def _gpt_task(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device, stage: torch.nn.Module) -> StepTask:
    family = model_family(cfg.model)
    flops_tok = family.flops_per_token(cfg.model, cfg.data.seq_length)
    gbs = global_batch_size(cfg, mesh.dims.dp)
    return StepTask(
        forward_backward=lambda micro, buckets: run_micro_batches(stage, micro, mesh, cfg, device, buckets),
        step_flops=lambda stats: gbs * cfg.data.seq_length * flops_tok, routed_experts=family.has_routed_experts(cfg.model))


def _dpo_task(cfg, mesh, device, stage, reference, lm: StepTask, table=None) -> StepTask:
    """DPO on the loop: the loss is per pair; FLOPs: the policy's forward+backward and the reference's forward
    over both answers of every pair (2 sequences per sample, 4/3 of a training pass; the policy's alone with the
    precomputed reference log-probs ``table``)."""
    gbs = global_batch_size(cfg, mesh.dims.dp)
    flops = lm.step_flops(None) * 2 * (1 if table is not None else 4 / 3) if gbs else 0.0
    table = torch.as_tensor(table, device=device) if table is not None else None
    return StepTask(
        forward_backward=lambda micro, buckets: run_dpo_micro_batches(stage, reference, micro, mesh, cfg, device,
                                                                      buckets, schedule_micro_batches, table),
        step_flops=lambda stats: flops, extra_metrics=dpo_metrics, routed_experts=lm.routed_experts)


@torch.no_grad()
def _evaluate(stage: torch.nn.Module, batches, mesh: ParallelMesh, cfg, task: StepTask, num_micro: int) -> float:
    """Mean token loss over ``eval_steps`` global batches of the valid split."""
    stage.eval()
    micro = [batches.next() for _ in range(cfg.train.eval_steps * num_micro)]
    stats = reduce_loss_stats(task.forward_backward(micro, None), mesh)
    stage.train()
    return (stats[0] / stats[1]).item()


def _checkpoint_records(cfg, lr_schedule: LrSchedule, dp: int) -> dict:
    """What every checkpoint stores in complete.json besides its config: the resume records, and for a GPT run
    on text data the tokenizer its data's manifests name (what evaluation, generation and the HF export check
    against; the samples were built already, so the manifests were read and agree)."""
    records = resume_records(cfg, lr_schedule, dp)
    if isinstance(cfg, GPTRunConfig) and cfg.train.objective == "grpo":  # the tokenizer of its prompts
        return {**records, "tokenizer": load_tokenizer(cfg.grpo.tokenizer).describe()}
    if not isinstance(cfg, GPTRunConfig) or cfg.data.type != "gpt" or cfg.data.mock:
        return records
    from mmtrain.data.blend import data_tokenizer  # as _build_samples imports it: not for mock data

    tokenizer = data_tokenizer(cfg)
    return {**records, "tokenizer": tokenizer} if tokenizer is not None else records


def train_gpt(cfg: GPTRunConfig, mesh: ParallelMesh, device: torch.device) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps on this rank's stage/shard of the model."""
    dims = mesh.dims
    torch.manual_seed(cfg.train.seed)
    stage = build_gpt_stage(cfg, mesh, device)
    found = find_checkpoint(cfg.checkpoint.load, cfg.logging.run_dir)
    if found is not None and is_weights_only(found):
        # converted weights, any layout: loaded before the optimizer copies its fp32 masters
        from mmtrain.convert.checkpoint_io import load_model_weights

        load_model_weights(found, mesh, stage, run_model_cfg=cfg.model, verify=cfg.checkpoint.verify)
        get_logger("train").info(f"initialized from weights-only checkpoint {found}; training starts at step 0")
    lr_schedule = resolve_resume(found, cfg, dims.dp)  # before the data is built: a changed order is an error
    index_builder = mesh.node_local_rank == 0  # one process per node builds the data indices
    train_samples = _build_samples(cfg, "train", dims.dp, index_builder)
    # packed documents: the loader hands each micro-batch its positions, document ids and loss mask
    # (SFT samples carry their own conversations; preference pairs are cut by the DPO step)
    documents = (DocumentRule.from_config(cfg.data, getattr(train_samples, "eod_id", None))
                 if cfg.data.type == "gpt" else None)
    batches = MicroBatches(train_samples, cfg.train.micro_batch_size, mesh.coord.dp, dims.dp, documents=documents)
    val_batches = None
    if cfg.train.eval_every:
        val_batches = MicroBatches(_build_samples(cfg, "valid", dims.dp, index_builder), cfg.train.micro_batch_size,
                                   mesh.coord.dp, dims.dp, documents=documents)
    task = _gpt_task(cfg, mesh, device, stage)
    if cfg.train.objective == "dpo" and cfg.dpo.reference_logps == "precomputed":
        task = _dpo_task(cfg, mesh, device, stage, None, task, train_samples.reference_logps)
    elif cfg.train.objective == "dpo":
        reference = build_reference(cfg, mesh, device, found, build_gpt_stage)
        cast_frozen_params(reference, _param_dtype_for(cfg.train.precision))  # computes as the policy does
        if cfg.parallel.fsdp:  # sharded like the policy: its blocks gathered for their forward only (the
            fully_sharded_frozen(reference, mesh)  # buckets live on in the hooks they put on its blocks)
        task = _dpo_task(cfg, mesh, device, stage, reference, task)
    elif cfg.train.objective == "grpo":
        reference = None
        if cfg.grpo.beta > 0:
            reference = build_reference(reference_config(cfg, found), mesh, device, found, build_gpt_stage)
            cast_frozen_params(reference, _param_dtype_for(cfg.train.precision))
        step = grpo_step(cfg, mesh, device, stage, reference, train_samples, schedule_micro_batches, found)
        task = StepTask(step.forward_backward, step.step_flops, step.extra_metrics, task.routed_experts)
    elif cfg.train.objective == "distill":
        task = distill_task(cfg, mesh, device, stage, task, _param_dtype_for(cfg.train.precision), run_micro_batches,
                            schedule_micro_batches)
    return train_model(cfg, mesh, device, stage, batches, val_batches, task,
                       found, model_name=cfg.model.shape().name, lr_schedule=lr_schedule)


def train_model(cfg, mesh: ParallelMesh, device: torch.device, stage: torch.nn.Module, batches, val_batches,
                task: StepTask, found: Path | None, model_name: str,
                lr_scale_of: Callable[[torch.nn.Parameter], float] | None = None,
                lr_schedule: LrSchedule | None = None) -> TrainResult:
    """The shared part of a run: gradient buckets and optimizer over the trainable parameters (frozen ones,
    ``requires_grad=False``, get neither gradients nor optimizer state), resume from ``found`` (a full
    checkpoint; weights-only ones were loaded by the caller), then the steps. ``batches``/``val_batches`` have
    ``next()`` and ``state_dict()``/``load_state_dict()``; ``lr_scale_of(param)`` multiplies its learning rate.
    ``lr_schedule``: what ``resolve_resume`` decided for ``found`` (checked here when not given)."""
    log = get_logger("train")
    dims = mesh.dims
    weights_only = found is not None and is_weights_only(found)
    if lr_schedule is None:
        lr_schedule = resolve_resume(found, cfg, dims.dp)
    params = [p for p in stage.parameters() if p.requires_grad]
    o = cfg.optim
    pdtype = _param_dtype_for(cfg.train.precision)
    cast_frozen_params(stage, pdtype)
    grad_dtype = torch.float32 if o.master_weights else pdtype
    dense, experts = split_by_reduce_group(stage, params)
    precision = precision_for(stage, cfg, mesh)
    if cfg.parallel.fsdp:  # parameters and gradients sharded too, gathered per block (low-precision copies as they are)
        buckets = fully_sharded_buckets(stage, dense, experts, mesh, pdtype, grad_dtype, precision)
    else:
        buckets = [GradBuckets(dense, mesh.dp_cp_group, cfg.parallel.distributed_optimizer, pdtype,
                               late_params=tied_embedding_params(stage), grad_dtype=grad_dtype,
                               **precision.bucket_options())]
        precision.attach(buckets[0])
        if experts:  # expert weights are replicated only over the expert-data-parallel ranks
            buckets.append(GradBuckets(experts, mesh.edp_group, cfg.parallel.distributed_optimizer, pdtype,
                                       grad_dtype=grad_dtype))
    optimizer = MixedPrecisionAdamW(buckets, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.master_weights,
                                    lr_scale_of=lr_scale_of)
    gbs = global_batch_size(cfg, dims.dp)
    num_micro = gbs // (cfg.train.micro_batch_size * dims.dp)
    start_step = 0
    ckpt_root = Path(cfg.logging.run_dir) / "checkpoints"
    if found is not None and not weights_only:
        restored = load_checkpoint(found, mesh, stage, optimizer, device, verify=cfg.checkpoint.verify)
        start_step = restored["step"]
        try:
            batches.load_state_dict(restored["loader"])
            if val_batches is not None and restored["valid_loader"] is not None:  # evaluations continue their order
                val_batches.load_state_dict(restored["valid_loader"])
        except ValueError as exc:  # a loader state this run's data cannot continue: one line, no traceback
            raise CheckpointError(f"{found}: cannot resume the data loader: {exc}") from None
    sinks = []
    if cfg.logging.wandb and mesh.rank == 0:  # wandb is imported here, on rank 0 only
        sinks.append(WandbSink(cfg.logging, cfg.logging.run_dir, dataclasses.asdict(cfg)))
    metrics = MetricsLogger(cfg.logging.run_dir, mesh.rank, cfg.train.steps, cfg.logging.log_every,
                            cfg.logging.tensorboard, resume_step=start_step, sinks=sinks)
    n_params = sum(p.numel() for p in stage.parameters())
    n_frozen = n_params - sum(p.numel() for p in params)
    frozen = f" ({n_frozen / 1e6:.2f}M frozen)" if n_frozen else ""
    log.info(f"model {model_name}: {n_params / 1e6:.2f}M parameters on this rank{frozen}; global batch {gbs} x "
             f"{cfg.data.seq_length} tokens = {num_micro} micro-batch(es) of {cfg.train.micro_batch_size} per DP rank")
    hooks: list[StepHooks] = [precision]
    # ranks that saw different tokens: dp×cp, and tp under sequence parallelism (a VLM: its LM's experts)
    if task.routed_experts:
        hooks.append(RouterBiasBalancer(stage, mesh, cfg.parallel.sequence_parallel))
    hooks.append(PreemptionCheck(mesh, device))
    t = cfg.train
    if t.sample_every:  # greedy samples at logging steps (a VLM samples its language model on text prompts)
        hooks.append(SampleLogger(getattr(stage, "language", stage), t.sample_prompts, t.sample_tokenizer,
                                  t.sample_every, t.sample_max_new_tokens, mesh.rank, weights=optimizer))
    for h in hooks:
        h.start()
    run = _Run(cfg, mesh, device, stage, buckets, optimizer, batches, val_batches, task, metrics,
               CheckpointWriter(ckpt_root, mesh, cfg.checkpoint.async_save), hooks,
               TrainResult(model=stage, optimizer=optimizer), gbs, num_micro, lr_schedule,
               _checkpoint_records(cfg, lr_schedule, dims.dp), StepClock(device))
    if cfg.train.exit_at_step and start_step >= cfg.train.exit_at_step:
        log.info(f"resumed at step {start_step}, not before train.exit_at_step={cfg.train.exit_at_step}: "
                 "nothing to run (leave train.exit_at_step out to continue)")
    try:
        run.steps(start_step)
        optimizer.gather_full_params()  # a precision layer may leave weights partial: the model is returned whole
    finally:
        run.writer.close()
        for h in hooks:
            h.close()
        metrics.close()
    return run.result


@dataclass
class _Run:
    """Everything one training run's step needs, and the phase it is in (for failure reports).

    A step makes no host sync: loss, grad norm and the finite flag stay on the device (a non-finite step's update
    is skipped there, ``MixedPrecisionAdamW.step(skip=...)``) and are read back, for every step since the last
    one, at *sync points*: logging steps (``logging.log_every``), evaluation and checkpoint steps, the last step,
    and a preemption. Only then are the metrics rows written and the NaN/Inf policy applied."""

    cfg: GPTRunConfig
    mesh: ParallelMesh
    device: torch.device
    stage: torch.nn.Module
    buckets: list
    optimizer: MixedPrecisionAdamW
    batches: MicroBatches
    val_batches: MicroBatches | None
    task: StepTask
    metrics: MetricsLogger
    writer: CheckpointWriter
    hooks: list[StepHooks]
    result: TrainResult
    gbs: int
    num_micro: int
    lr_schedule: LrSchedule
    records: dict  # the schedule and data-order inputs every checkpoint records
    clock: StepClock  # each step's duration, on the run's device's timeline
    skipped: int = 0
    phase: str = "start-up"
    pending: list[PendingStep] = field(default_factory=list)

    def steps(self, start_step: int) -> None:
        """The step loop; a collective that times out is re-raised naming rank, step and phase."""
        step = start_step
        try:
            last = self.cfg.train.exit_at_step or self.cfg.train.steps
            for step in range(start_step + 1, last + 1):
                if not self.step(step):
                    break
        except RuntimeError as exc:
            if is_collective_timeout(exc):
                raise CollectiveTimeout(collective_timeout_report(
                    exc, self.mesh.rank, step, self.phase, self.cfg.parallel.collective_timeout_s)) from exc
            raise

    def step(self, step: int) -> bool:
        """One optimizer step (plus logging, evaluation, checkpoint); False when the run must stop (preempted)."""
        cfg, mesh, stage, optimizer = self.cfg, self.mesh, self.stage, self.optimizer
        log = get_logger("train")
        began = self.clock.begin()
        lr = self.lr_schedule.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        micro_batches = [self.batches.next() for _ in range(self.num_micro)]
        for b in self.buckets:
            b.reset()
        self.phase = "forward/backward"
        local = self.task.forward_backward(micro_batches, self.buckets)
        for b in self.buckets:  # the gradient reductions a rank has not started yet go first, on every rank
            b.launch_pending()
        for h in self.hooks:
            h.after_backward(step)
        self.phase = "gradient reduction"
        stats = reduce_loss_stats(local.clone(), mesh)
        finalize_grads(stage, mesh, self.buckets, optimizer, stats[1])  # 1 / tokens on the device
        self.phase = "gradient clipping and optimizer step"
        grad_norm = clip_grad_norm(stage, mesh, optimizer, cfg.optim.grad_clip)
        # every rank has the same reduced loss and norm: all skip the same steps, decided on the device
        loss = stats[0] / stats[1]
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        optimizer.step(skip=~finite)
        for h in self.hooks:
            h.after_optimizer_step(step)
        values, ready = queue_readout(loss, grad_norm, finite, stats)
        self.pending.append(PendingStep(step, lr, local[0].detach().clone(), values, ready, began, self.clock.end(),
                                        [h.step_metrics(step) for h in self.hooks]))
        c = cfg.checkpoint
        exiting = step == cfg.train.exit_at_step
        evaluate = self.val_batches is not None and step % cfg.train.eval_every == 0
        save = bool((c.save_every and step % c.save_every == 0) or (c.save_final and step == cfg.train.steps)
                    or exiting)
        sync_point = (step % cfg.logging.log_every == 0 or step == cfg.train.steps or exiting or save or evaluate)
        self.phase = "checkpoint save"
        preempted = any([h.stop_requested(sync_point) for h in self.hooks])  # a list: every hook is asked
        # logging every step: read the step before this one back, not this one, so the device always has a step
        # queued while the host prepares the next (a read of this step would drain its queue every step); steps
        # that save, evaluate, end or stop the run read everything
        lag = cfg.logging.log_every == 1 and not (save or evaluate or preempted or exiting or step == cfg.train.steps)
        if sync_point or preempted:
            self._read_back(evaluate, keep_newest=lag)
        if save or evaluate:
            self.clock.pause()
        if save or preempted:
            self.phase = "checkpoint save"
            self.writer.save(step, stage, optimizer, self.batches.state_dict(), self.device, c.keep_last,
                             dataclasses.asdict(cfg), force_sync=preempted, records=self.records,
                             valid_loader_state=None if self.val_batches is None else self.val_batches.state_dict())
        if preempted:
            log.warning(f"SIGTERM received: saved step {step} to {self.writer.root}; exiting (a restart resumes)")
            self.result.preempted = True
            return False
        if exiting and step < cfg.train.steps:
            log.info(f"train.exit_at_step={step} reached: saved step {step} to {self.writer.root}; the same command "
                     f"without it continues to train.steps={cfg.train.steps}")
            return False
        return True

    def _read_back(self, evaluate: bool, keep_newest: bool = False) -> None:
        """A sync point: read the pending steps' numbers (a wait for the newest of them only), apply the NaN/Inf
        policy in step order, evaluate if due, write one metrics row per pending step. ``keep_newest``: the step
        just run stays pending (read at the next sync point)."""
        cfg, mesh, device, dims = self.cfg, self.mesh, self.device, self.mesh.dims
        log = get_logger("train")
        split = len(self.pending) - 1 if keep_newest else len(self.pending)
        pending, self.pending = self.pending[:split], self.pending[split:]
        if not pending:
            return
        self.phase = "metrics read-back"
        rows = []
        for p in pending:
            (loss, grad_norm, finite), step_stats = p.read()  # waits for this step only, not the ones queued after
            dt = self.clock.seconds(p.began, p.ended)
            if not finite:
                problem = nonfinite_report(p.step, loss, grad_norm, p.local_loss, device)
                self.skipped += 1
                t = cfg.train
                if t.nan_policy == "stop" or self.skipped > t.max_skipped_steps:
                    raise NonFiniteError(f"{problem}; stopping (train.nan_policy={t.nan_policy}, {self.skipped} "
                                         f"step(s) skipped, train.max_skipped_steps={t.max_skipped_steps})")
                log.warning(f"{problem}; update skipped ({self.skipped} of at most {t.max_skipped_steps})")
            tokens_per_s = self.gbs * cfg.data.seq_length / dt / dims.world_size  # per device
            row = {"loss": loss, "lr": p.lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                   "tflops": self.task.step_flops(step_stats) / dt / dims.world_size / 1e12, "step_time_s": dt,
                   **self.task.extra_metrics(step_stats, dt)}
            if cfg.logging.peak_tflops:
                row["mfu"] = row["tflops"] / cfg.logging.peak_tflops
            if device.type == "cuda":
                row["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if not finite:
                row["skipped"] = 1
            for h, values in zip(self.hooks, p.hook_metrics):
                row.update(h.host_metrics(values))
                if values and isinstance(h, SampleLogger):
                    self.clock.pause()  # the samples' generation is not the next step's time
            rows.append((p.step, row))
            self.result.losses.append(loss)
            self.result.grad_norms.append(grad_norm)
            self.result.step_times.append(dt)
        if evaluate:
            self.phase = "evaluation"
            step, row = rows[-1]
            row["val_loss"] = self.result.val_losses[step] = _evaluate(self.stage, self.val_batches, mesh, cfg,
                                                                       self.task, self.num_micro)
        for step, row in rows:
            self.metrics.log_step(step, row)
