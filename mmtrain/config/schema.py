"""The run configuration: nested dataclasses, one documented default per field.

YAML files under ``configs/`` only overlay these defaults and dotted ``key=value`` overrides win last
(see ``mmtrain.config.loader``). Every field carries its help text in ``metadata["help"]``; the
configuration reference in ``docs/`` is generated from it, so the text here is the documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmtrain.config.family_sections import family_name_type, section_class, with_family_sections
from mmtrain.config.fields import doc
from mmtrain.config.grpo_schema import GrpoConfig
from mmtrain.config.loader import ConfigError
from mmtrain.models.families import FAMILY_PACKAGES, INLINE_FAMILY, FamilySection, unknown_family_message

__all__ = ["doc"]  # re-exported: the other schema modules declare their fields with it

InlineShape = section_class(INLINE_FAMILY)  # the inline (Llama) family's section: ModelConfig's own fields, model.*
FamilyName = family_name_type()  # a str among the family table's names (mmtrain/models/families.py)


@dataclass
class _FamilyChoice:
    """``model.family``, first of the model section (a base class: dataclass fields of bases come first)."""

    family: FamilyName = doc(
        INLINE_FAMILY, f"Model family, a name of the table in mmtrain/models/families.py: {INLINE_FAMILY} (the shape "
                       "fields of this section) or another family (its shape is model.<family>; the fields of every "
                       "other family, this section's own included, must then keep their defaults).")


@dataclass
@with_family_sections
class ModelConfig(InlineShape, _FamilyChoice):
    """Shape of the decoder-only language model: the Llama family's shape (the fields below), or another
    family's shape in its own section ``model.<family>``, chosen by ``family``."""

    def shape(self) -> FamilySection:
        """The chosen family's shape (this section for the Llama family, else ``model.<family>``): what
        family-neutral code reads ``name``, ``vocab_size``, ``hidden_size`` and ``num_layers`` from, and checks
        with ``check`` / ``check_layout``."""
        if self.family not in FAMILY_PACKAGES:
            raise ConfigError(unknown_family_message(self.family))
        return self if self.family == INLINE_FAMILY else getattr(self, self.family)

    def shape_prefix(self, model_key: str = "model") -> str:
        """Where the chosen family's shape fields sit in the run config: ``model.`` or ``model.<family>.``."""
        return f"{model_key}." if self.family == INLINE_FAMILY else f"{model_key}.{self.family}."


@dataclass
class ParallelConfig:
    """How the ranks are laid out; the product tp*pp*cp*dp must equal the world size."""

    tp: int = doc(1, "Tensor-parallel size (splits heads and MLP columns).", ge=1)
    pp: int = doc(1, "Pipeline-parallel size (splits the layers into stages).", ge=1)
    cp: int = doc(1, "Context-parallel size (splits each sequence).", ge=1)
    dp: int = doc(0, "Data-parallel size; 0 infers it as world_size / (tp*pp*cp).", ge=0)
    ep: int = doc(1, "Expert-parallel size; experts are sharded over the dp*cp ranks, so ep must divide dp*cp.", ge=1)
    ep_dispatch: Literal["exact", "padded"] = doc(
        "exact", "Expert-parallel all-to-all splits: exact (the tokens each rank routes; one host read of the "
                 "counts per MoE layer and micro-batch) or padded (a fixed worst-case block per rank: no host sync, "
                 "never drops a token, up to ep*min(top_k, experts per rank)/top_k times the bytes).")
    ep_overlap_shared: bool = doc(False, "Run the shared experts while the expert-parallel all-to-all carries "
                                         "the tokens (asynchronous exchange); same results.")
    cp_comm: Literal["allgather", "ring"] = doc(
        "allgather", "How context parallelism moves K/V: allgather (one all-gather per layer before attention, "
                     "exposed; saves the whole sequence's K/V) or ring (each rank's K/V block passed around the CP "
                     "ring, each send/receive running while the block in hand is attended to; backward "
                     "a ring too). Same results; docs/parallelism.md.")
    sequence_parallel: bool = doc(False, "Shard norms and residuals along the sequence over the TP group.")
    pipeline_layers: list[int] = doc([], "Layers per pipeline stage, e.g. [3, 5, 5, 3]; empty splits evenly.", ge=1)
    virtual_pp: int = doc(1, "Virtual pipeline stages per rank (interleaved 1F1B) when > 1.", ge=1)
    distributed_optimizer: bool = doc(True, "Shard optimizer state and fp32 master weights over data-parallel ranks.")
    fsdp: bool = doc(False, "Fully sharded data parallelism (ZeRO-3): also shard each transformer block's parameters "
                            "and gradients over the data-parallel ranks, all-gathered per block ahead of use and "
                            "freed after; needs parallel.distributed_optimizer=true (docs/parallelism.md).")
    backend: Literal["auto", "nccl", "gloo"] = doc("auto", "torch.distributed backend; auto picks nccl on GPU, gloo on CPU.")
    collective_timeout_s: float = doc(600.0, "Seconds a collective may wait before the run stops with a report "
                                             "naming the rank and the operation.", gt=0)


@dataclass
class DataConfig:
    """Where training tokens come from."""

    mock: bool = doc(False, "Use random tokens instead of a dataset (benchmarks and smoke tests).")
    type: Literal["gpt", "sft", "preference"] = doc(
        "gpt", "gpt: samples of seq_length + 1 tokens running across documents (pretraining). sft: whole "
               "conversations of `mmtrain-prep sft` outputs (data.prefixes), loss only where their loss mask says, "
               "packed with per-conversation attention and positions. preference: chosen/rejected pairs of "
               "`mmtrain-prep sft --preference` (one prefix) for train.objective=dpo (docs/post-training.md).")
    sft_pack: bool = doc(True, "data.type=sft: pack several conversations into each sample (false: one per "
                               "sample, padded).")
    prefixes: list[str] = doc([], "Indexed dataset prefixes (path without .bin/.idx); used when no blend is given.")
    blend: str = doc("", "Path of a blend-spec YAML file (docs/blend-spec.md); wins over `prefixes`.")
    seq_length: int = doc(128, "Tokens per training sample.", ge=1)
    split: str = doc("969,30,1", "Train/valid/test split of the documents, as relative weights.")
    seed: int = doc(1234, "Seed of the document and sample shuffling.", ge=0, le=2**32 - 1)
    cache_dir: str = doc("", "Folder for the cached sample indices; empty means PREFIX.cache/ next to the first dataset.")
    weights: list[float] = doc([], "Weights of data.prefixes, one per prefix; empty weighs each prefix by its token "
                                    "count in the split (data.prefixes may also be Megatron's 'w1 p1 w2 p2' list).", gt=0)
    reset_position_ids: bool = doc(False, "Restart position ids after every end-of-document token in packed samples.")
    reset_attention_mask: bool = doc(False, "Give each packed document its own document id so attention does not "
                                            "cross documents.")
    eod_mask_loss: bool = doc(False, "Mask the loss where the input token is the end-of-document token.")
    index_build_timeout_s: float = doc(1800.0, "Seconds a process waits for LOCAL_RANK 0 to build the sample "
                                               "indices.", gt=0)
    num_workers: int = doc(0, "Media loader worker processes per rank of a VLM run (decoding and cooking media; the "
                              "order does not depend on it). The text loader reads memory-mapped samples in the "
                              "training process and uses no workers.", ge=0)


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = doc(3e-4, "Peak learning rate.", gt=0)
    min_lr: float | None = doc(None, "Learning rate at the end of the decay; null (default): optim.lr / 10, so "
                                     "setting only optim.lr keeps the two consistent.", ge=0)
    weight_decay: float = doc(0.1, "Decoupled weight decay; never applied to norms, biases or embeddings' rows of ones.", ge=0)
    beta1: float = doc(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = doc(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = doc(1e-8, "AdamW epsilon.", gt=0)
    master_weights: bool = doc(True, "Keep fp32 master weights, gradients and Adam moments; false keeps them in the "
                                     "parameter dtype (bf16), the plain-AdamW setup of the benchmark anchors.")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this value; 0 disables clipping.", ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = doc("cosine", "Learning-rate schedule after warmup.")
    warmup_steps: int = doc(10, "Linear warmup steps from 0 to `lr`.", ge=0)
    decay_fraction: float = doc(0.2, "WSD only: fraction of the steps spent in the final decay.", ge=0, le=1)

    def final_lr(self) -> float:
        """The learning rate the decay ends at: ``min_lr``, or a tenth of ``lr`` when it is not set."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass
class TrainConfig:
    """The step loop."""

    steps: int = doc(20, "Optimizer steps to run.", ge=1)
    objective: Literal["lm", "dpo", "grpo", "distill"] = doc(
        "lm", "lm: next-token cross-entropy (pretraining, SFT). dpo: preference optimization against a frozen "
              "reference (the dpo section; data.type=preference). grpo: group relative policy optimization on "
              "the model's own completions (the grpo section). distill: knowledge distillation from a frozen "
              "teacher (the distill section).")
    micro_batch_size: int = doc(2, "Samples per micro-batch per data-parallel rank.", ge=1)
    global_batch_size: int = doc(0, "Samples per optimizer step over all ranks; 0 means micro_batch_size * dp.", ge=0)
    precision: Literal["fp32", "bf16", "fp8"] = doc("bf16", "Compute precision; master weights stay fp32; fp8: "
                                                                    "BF16 weights, FP8 block linears (the fp8 section).")
    activation_checkpointing: Literal["none", "selective", "full"] = doc("none", "Recompute activations in backward.")
    compile: bool = doc(False, "torch.compile each transformer block (and the loss on one TP rank); with GRPO "
                        "also the rollouts' decode step (CUDA graphs on a GPU).")
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = doc(
        "auto", "scaled_dot_product_attention kernel on GPU; auto lets PyTorch choose.")
    document_attention: Literal["auto", "flex", "flex_flash", "dense"] = doc(
        "auto", "Kernel of document-masked attention (data.reset_attention_mask, VLM packing): flex = FlexAttention "
                "block masks (GPU), flex_flash = the same masks run by flash-attn-4's CuTe kernels (FlexAttention's "
                "FLASH backend; Hopper/Blackwell, the flash extra), dense = an S x S mask for SDPA (the reference; "
                "slow, large); auto = flex on GPU, dense on the CPU, where FlexAttention has no backward.")
    seed: int = doc(42, "Seed of the weight initialization and dropout.", ge=0, le=2**63 - 1)
    eval_every: int = doc(0, "Evaluate on the valid split every N steps; 0 disables.", ge=0)
    eval_steps: int = doc(4, "Global batches per evaluation (the same samples whatever the parallel layout).", ge=1)
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "Where to run; auto picks cuda when available.")
    nan_policy: Literal["skip", "stop"] = doc("skip", "On a NaN/Inf loss or gradient norm: skip the step's update, "
                                                      "or stop with a report naming the step and ranks.")
    max_skipped_steps: int = doc(10, "With nan_policy=skip: stop once more than this many steps were skipped.", ge=0)
    exit_at_step: int = doc(0, "Stop after this step, with a checkpoint, as if preempted: the learning-rate schedule "
                               "and the data order still span train.steps, so the same command without it continues "
                               "exactly as one uninterrupted run; 0 runs to train.steps.", ge=0)
    sample_every: int = doc(0, "Every N steps, complete train.sample_prompts greedily with the current weights "
                               "(KV-cache decoding) and log them: the console, metrics.jsonl (`samples`) and "
                               "TensorBoard text; a multiple of logging.log_every; 0 disables.", ge=0)
    sample_prompts: list[str] = doc([], "Prompts of train.sample_every.")
    sample_tokenizer: str = doc("", "Tokenizer of train.sample_prompts (the data's: SentencePiece .model, "
                                    "tokenizer.json or its folder, GPT-2 vocab.json next to merges.txt).")
    sample_max_new_tokens: int = doc(32, "New tokens per sample at most (fewer at the end-of-document token).",
                                     ge=1, le=4096)


@dataclass
class LoggingConfig:
    """What is printed and written during a run."""

    run_dir: str = doc("runs/default", "Folder of this run: resolved config, metrics, checkpoints.")
    log_every: int = doc(1, "Print one metrics line every N steps (rank 0). At 1, a step's line comes once the next "
                            "step is queued (reading a step back as it ends would drain the device every step).", ge=1)
    tensorboard: bool = doc(False, "Also write TensorBoard event files to run_dir/tb (needs the tensorboard package).")
    peak_tflops: float = doc(0.0, "Per-device peak TFLOP/s for MFU; 0 hides MFU.", ge=0)
    wandb: bool = doc(False, "Also log to Weights & Biases from rank 0: every metrics.jsonl figure per step and "
                             "the resolved config (needs the wandb package: pip install 'mmtrain[wandb]'). A "
                             "resumed run continues the same W&B run (id in run_dir/wandb_run_id).")
    wandb_project: str = doc("mmtrain", "W&B project of the run.")
    wandb_name: str = doc("", "W&B run name; empty: the name of logging.run_dir's folder.")
    wandb_entity: str = doc("", "W&B entity (user or team); empty: the account's default.")
    wandb_tags: list[str] = doc([], "W&B tags of the run.")
    wandb_mode: Literal["online", "offline", "disabled"] = doc(
        "online", "online uploads as the run goes; offline writes run_dir/wandb/ only (upload later with "
                  "`wandb sync`); disabled logs nothing.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save_every: int = doc(0, "Save a checkpoint every N steps; 0 saves only at the end if `save_final`.", ge=0)
    save_final: bool = doc(True, "Save a checkpoint after the last step.")
    keep_last: int = doc(2, "Keep only the newest N checkpoints; 0 keeps all.", ge=0)
    async_save: bool = doc(False, "Write checkpoints in a background thread; the step waits only for a copy to "
                                  "pinned host memory.")
    load: str = doc("", "Checkpoint folder to resume from; empty resumes from run_dir/checkpoints/latest if present.")
    schedule_change: Literal["error", "use_config", "use_checkpoint"] = doc(
        "error", "Resuming with another learning-rate schedule than the checkpoint's (train.steps, optim.lr, min_lr, "
                 "warmup_steps, schedule, decay_fraction): error names each changed key; use_config continues "
                 "with this run's schedule from the resumed step (the learning rate jumps); use_checkpoint keeps "
                 "the checkpoint's schedule (the run still stops at this run's train.steps).")
    data_order_change: Literal["error", "use_config"] = doc(
        "error", "Resuming with other data-order inputs than the checkpoint's (data.seed, seq_length, blend, "
                 "prefixes, weights, split, mock, the global batch size, and train.steps, which sizes the sample "
                 "indices; for a VLM also media.slices, shuffle_buffer_size, pack, packing_buffer_size): error "
                 "names each changed key; use_config builds this run's order and continues at the checkpoint's consumed-sample count in it (samples may "
                 "repeat or be skipped).")
    verify: bool = doc(True, "Check every checkpoint file against the XXH3 hash recorded when it was written "
                             "(checksums.json) before reading it; a damaged or missing file stops the run. false reads "
                             "the data files unchecked (complete.json's seal and the metadata's sizes are always "
                             "checked).")


@dataclass
class LoraConfig:
    """LoRA adapters on chosen linears; the base model is frozen (docs/post-training.md)."""

    rank: int = doc(0, "Adapter rank r; 0 turns LoRA off (full fine-tuning or pretraining).", ge=0)
    alpha: float = doc(16.0, "Scaling numerator: the adapter adds (alpha / rank) * B A x.", gt=0)
    targets: list[str] = doc([], "Linears that get an adapter, by their name in a block; empty: all the family's "
                                 "shape has (its section's lora_targets()). Per family in docs/post-training.md: "
                                 "llama qkv (fused q|k|v), proj, up (fused gate|up), down (MoE models: qkv, proj); "
                                 "deepseek_v3 q_down, q_up (or q_proj), kv_down, kv_up, proj, up, down, shared_up, "
                                 "shared_down. Routed experts have none.")
    dora: bool = doc(False, "DoRA (peft's use_dora): each adapted linear's weight W + (alpha/rank) B A is "
                            "re-normalized per output feature and scaled by a trained magnitude vector that "
                            "starts at the row norms of W (docs/post-training.md, DoRA).")

    def targets_for(self, model: "ModelConfig") -> tuple[str, ...]:
        """The targets this run adapts for ``model``: ``targets``, or all its family's shape allows when empty."""
        return tuple(self.targets) if self.targets else model.shape().lora_targets()


@dataclass
class DpoConfig:
    """Direct preference optimization (train.objective: dpo)."""

    beta: float = doc(0.1, "Strength of the pull towards the reference model (the rewards' scale).", gt=0)
    loss: Literal["sigmoid", "ipo"] = doc("sigmoid", "sigmoid: -log sigmoid(beta h) (DPO); ipo: (h - 1/(2 beta))^2 "
                                                     "with each answer's log-ratio divided by its loss tokens "
                                                     "(TRL's IPO).")
    reference: str = doc("", "Weights-only checkpoint of the frozen reference model; empty: the run's initial "
                             "weights (the weights-only checkpoint.load, else the seeded init).")
    reference_logps: Literal["model", "precomputed"] = doc(
        "model", "model: run the frozen reference model every step; precomputed: read its log-probs from "
                 "PREFIX.dpo_reference.bin beside the preference shards (python -m mmtrain.dpo_reference writes "
                 "them once, checksummed) and build no reference model.")


@dataclass
class DistillConfig:
    """Knowledge distillation (train.objective: distill; docs/distillation.md): per loss token,
    ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(label)``, both distributions at temperature T."""

    teacher: str = doc("", "The frozen teacher: an mmtrain checkpoint (a checkpoints root with latest, or a step "
                           "folder; a Hugging Face model after python -m mmtrain.convert hf-to-mmtrain). Its family "
                           "and shape come from its complete.json and may differ from the student's; its tokenizer "
                           "and vocab_size must be the student's.")
    temperature: float = doc(1.0, "Temperature T of the teacher's and the student's softmax in the KL term.", gt=0)
    alpha: float = doc(1.0, "Weight of the KL term against the hard-label cross-entropy: alpha * T^2 * KL + "
                            "(1 - alpha) * CE; 1 (the default): the teacher's distribution only.", gt=0, le=1)
    top_k: int = doc(0, "0: the KL over the whole vocabulary; k > 0: over the teacher's k most likely tokens, its "
                        "probabilities renormalized over them against the student's full softmax "
                        "(docs/distillation.md).", ge=0)


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning."""

    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapters."})


@dataclass
class Fp8Config:
    """FP8 training (``train.precision: fp8``; docs/fp8.md). The transformer blocks' linears (qkv, proj, MLP
    up/down) compute in FP8, and the output layer with ``output_layer``; embeddings, norms, attention and MoE
    experts stay BF16."""

    backend: Literal["auto", "native", "te"] = doc(
        "auto", "auto: Transformer Engine when it imports, else native (torch._scaled_mm); te fails if TE is missing.")
    recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"] = doc(
        "tensorwise", "Scaling: delayed (amax history), tensorwise (current per-tensor amax), rowwise (native: "
                      "per-row scales), blockwise (TE: 1x128/128x128 blocks), mxfp8 (TE, Blackwell: 1x32 blocks).")
    format: Literal["hybrid", "e4m3"] = doc(
        "hybrid", "hybrid: E4M3 activations and weights, E5M2 gradients; e4m3: E4M3 everywhere.")
    amax_history_len: int = doc(1024, "Delayed scaling: steps of amax history kept per tensor.", ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = doc(
        "max", "Delayed scaling: scale from the largest amax in the history or from the latest one.")
    margin: int = doc(0, "Scales are divided by 2**margin (headroom against overflow).", ge=0)
    bf16_first_layers: int = doc(0, "Keep this many first transformer blocks in BF16.", ge=0)
    bf16_last_layers: int = doc(0, "Keep this many last transformer blocks in BF16.", ge=0)
    output_layer: bool = doc(
        False, "Native backend: compute the output layer (LM head) in FP8 too: its forward, dgrad and wgrad GEMMs, "
               "with the recipe's scaling (its input and the logits gradient are cast like a block linear's). "
               "Off (BF16) by default, as in Transformer Engine and Megatron-Core: the head is the layer most "
               "sensitive to precision; check convergence before using it (bench/fp8_convergence.py).")
    param_gather: bool = doc(
        False, "Distributed optimizer: all-gather the FP8 linears' updated weights over data-parallel ranks in FP8 "
               "(half the bytes of BF16), straight into their FP8 copies. Native backend, tensorwise/delayed, "
               "parallel.distributed_optimizer=true; a no-op with one data-parallel rank.")
    fast_accum_backward: bool = doc(
        False, "Native backend, tensorwise/delayed: fast accumulation (use_fast_accum) in the backward GEMMs too "
               "(dgrad, wgrad). Faster on Hopper, but the FP8 tensor cores then keep fewer accumulator bits over "
               "long contractions (wgrad sums over all tokens); false keeps full-precision accumulation, like TE.")


@dataclass
class RunSections:
    """The sections every run has, whatever it trains: a GPT run (``GPTRunConfig``) and a VLM run
    (``mmtrain.config.vlm_run_schema.VLMRunConfig``) both extend this class, so they share these classes."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "Parallel layout."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training data."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "Optimizer and schedule."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Step loop."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Logging."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})


@dataclass
class GPTRunConfig(RunSections):
    """Everything `python -m mmtrain.pretrain_gpt` needs: the shared run sections, the model and FP8."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Model shape."})
    fp8: Fp8Config = field(default_factory=Fp8Config, metadata={"help": "FP8 training (train.precision: fp8)."})
    peft: PeftConfig = field(default_factory=PeftConfig, metadata={"help": "Parameter-efficient fine-tuning (LoRA)."})
    dpo: DpoConfig = field(default_factory=DpoConfig, metadata={"help": "Preference optimization (train.objective: dpo)."})
    grpo: GrpoConfig = field(default_factory=GrpoConfig, metadata={"help": "Group relative policy optimization "
                                                                           "(train.objective: grpo)."})
    distill: DistillConfig = field(default_factory=DistillConfig,
                                   metadata={"help": "Knowledge distillation (train.objective: distill)."})
