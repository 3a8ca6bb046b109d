"""Cross-field checks that must fail before any process group is made.

Each check names the keys involved and the values, so the fix is obvious from the message alone.
"""

from __future__ import annotations

from pathlib import Path
import importlib.util

from mmtrain.config.family_sections import families_with, section_fields
from mmtrain.config.grpo_validate import check_grpo_run
from mmtrain.config.loader import ConfigError
from mmtrain.config.ranges import check_ranges
from mmtrain.config.schema import GPTRunConfig, ModelConfig
from mmtrain.models.families import family_names, unknown_family_message
from mmtrain.utils.optional import FLASH_PACKAGE, flash_available


def validate_gpt_config(cfg: GPTRunConfig, world_size: int | None = None) -> None:
    """Raise ``ConfigError`` on impossible combinations. With ``world_size`` also checks the layout."""
    check_ranges(cfg)  # every numeric field against the range declared in the schema
    check_language_run(cfg, world_size)


def _check_sampling(cfg: GPTRunConfig, mk: str) -> None:
    """train.sample_every: greedy samples at logging steps, from the whole model on each rank's TP group."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if not t.sample_prompts:
        raise ConfigError("train.sample_every is set but train.sample_prompts is empty; give the prompts to complete")
    if not t.sample_tokenizer:
        raise ConfigError("train.sample_every needs train.sample_tokenizer (the tokenizer the data was prepared with)")
    if not Path(t.sample_tokenizer).exists():
        raise ConfigError(f"train.sample_tokenizer={t.sample_tokenizer}: no such file or folder")
    if t.sample_every % cfg.logging.log_every:
        raise ConfigError(f"train.sample_every ({t.sample_every}) must be a multiple of logging.log_every "
                          f"({cfg.logging.log_every}): samples are taken at logging steps")
    if not m.shape().supports_train_sampling or p.pp > 1 or p.sequence_parallel or t.precision == "fp8":
        able = " or ".join(families_with("supports_train_sampling"))
        raise ConfigError(f"train.sample_every needs {mk}.family={able} (got {m.family}), parallel.pp=1, no "
                          "parallel.sequence_parallel and no fp8 (KV-cache decoding runs the whole model on each "
                          "rank's TP group); sample from a checkpoint with python -m mmtrain.generate instead")


def check_language_run(cfg: GPTRunConfig, world_size: int | None = None, model_key: str = "model") -> None:
    """The cross-field checks of a language model's run; its model's keys are named under ``model_key``
    (a VLM run checks ``VLMRunConfig.language_run()`` with ``model.language``). Ranges are the caller's."""
    m, p, t, d, o, mk = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.optim, model_key
    if o.min_lr is not None and o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    if t.exit_at_step > t.steps:
        raise ConfigError(f"train.exit_at_step ({t.exit_at_step}) is past train.steps ({t.steps}); the run would "
                          "never stop there")
    shape, sk = _check_model_shape(m, p, mk)
    if shape.num_layers < p.pp * p.virtual_pp:
        raise ConfigError(f"{sk}num_layers ({shape.num_layers}) must be >= parallel.pp * parallel.virtual_pp "
                          f"({p.pp} * {p.virtual_pp})")
    if p.virtual_pp > 1 and p.pp == 1:
        raise ConfigError("parallel.virtual_pp > 1 needs parallel.pp > 1")
    if p.pipeline_layers and len(p.pipeline_layers) != p.pp * p.virtual_pp:
        raise ConfigError(f"parallel.pipeline_layers has {len(p.pipeline_layers)} entries; it needs one per (virtual) "
                          f"stage: parallel.pp * parallel.virtual_pp = {p.pp * p.virtual_pp}")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
    if p.cp > 1 and d.seq_length % (2 * p.cp):
        raise ConfigError(f"data.seq_length ({d.seq_length}) must be divisible by 2 * parallel.cp ({2 * p.cp}) "
                          "for load-balanced context parallelism")
    if p.sequence_parallel and (d.seq_length // p.cp) % p.tp:
        raise ConfigError(f"data.seq_length / parallel.cp ({d.seq_length // p.cp}) must be divisible by parallel.tp "
                          f"({p.tp}) with sequence parallelism")
    if not d.mock and not d.prefixes and not d.blend and t.objective != "grpo":  # GRPO reads grpo.prompts
        raise ConfigError("no training data: set data.prefixes, data.blend, or data.mock=true")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install 'mmtrain[wandb]' (or set "
                          "logging.wandb=false)")
    if t.document_attention in ("flex", "flex_flash") and t.device == "cpu":
        raise ConfigError(f"train.document_attention={t.document_attention} needs a GPU (FlexAttention has no "
                          "backward on the CPU in this torch); use auto or dense")
    if t.document_attention == "flex_flash" and not flash_available():
        raise ConfigError(f"train.document_attention=flex_flash needs {FLASH_PACKAGE} (flash_attn.cute): "
                          "pip install 'mmtrain[flash]', or use flex")
    _validate_data(d)
    if (t.objective == "dpo") != (d.type == "preference"):
        raise ConfigError(f"train.objective={t.objective} with data.type={d.type}: DPO trains on preference pairs "
                          "and preference pairs only with DPO; set both train.objective=dpo and data.type=preference")
    if t.objective == "grpo":
        check_grpo_run(cfg, mk)
    if t.objective == "dpo" and p.cp > 1:
        raise ConfigError("train.objective=dpo does not support parallel.cp > 1 yet (sequence log-probs would be "
                          "split over the context ranks); use tp/pp/dp")
    _validate_distill(cfg, mk)
    if t.precision == "fp8" and t.device == "cpu":
        raise ConfigError("train.precision=fp8 needs a Hopper/Blackwell GPU; on the CPU use bf16 or fp32")
    if t.precision == "fp8" and not shape.supports_fp8:
        raise ConfigError(f"train.precision=fp8 supports {mk}.family={' or '.join(families_with('supports_fp8'))} "
                          f"only (got {m.family}); use bf16")
    if t.precision == "fp8":
        _validate_fp8(cfg, mk)
    lora = getattr(getattr(cfg, "peft", None), "lora", None)
    if lora is not None and lora.dora and not lora.rank:
        raise ConfigError("peft.lora.dora=true needs LoRA adapters: set peft.lora.rank > 0 (or peft.lora.dora=false)")
    if lora is not None and lora.rank:
        _validate_lora(cfg, lora, mk)
    if t.sample_every:
        _check_sampling(cfg, mk)
    if p.fsdp:
        _validate_fsdp(cfg)
    if world_size is not None:
        from mmtrain.parallel.dims import ParallelDims  # layout checks live with the layout

        dims = ParallelDims.from_config(p, world_size)
        if t.global_batch_size and t.global_batch_size % (t.micro_batch_size * dims.dp):
            raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                              f"train.micro_batch_size * dp ({t.micro_batch_size} * {dims.dp})")
        num_micro = (t.global_batch_size or t.micro_batch_size * dims.dp) // (t.micro_batch_size * dims.dp)
        if p.virtual_pp > 1 and num_micro % p.pp:
            raise ConfigError(f"with parallel.virtual_pp > 1 the micro-batches per step ({num_micro}) must be a "
                              f"multiple of parallel.pp ({p.pp}); raise train.global_batch_size")


def _validate_distill(cfg, mk: str) -> None:
    """train.objective=distill and the distill section (the teacher's checkpoint itself is read before any process
    group: mmtrain.train.distill_teacher.check_teacher)."""
    t, section = cfg.train, getattr(cfg, "distill", None)
    if section is None:
        return
    if t.objective != "distill":
        if section.teacher:
            raise ConfigError(f"distill.teacher is set but train.objective={t.objective}: set train.objective=distill "
                              "to distill from it, or leave distill.teacher out")
        return
    if mk != "model":
        raise ConfigError("train.objective=distill distills language models (python -m mmtrain.pretrain_gpt); a VLM "
                          "run trains with train.objective=lm")
    if not section.teacher:
        raise ConfigError("train.objective=distill needs distill.teacher: the teacher's mmtrain checkpoint "
                          "(docs/distillation.md)")
    if t.precision == "fp8":
        raise ConfigError("train.objective=distill with train.precision=fp8 is not supported yet; use "
                          "train.precision=bf16")


def _validate_fsdp(cfg) -> None:
    """parallel.fsdp: what the fully sharded buckets support so far (docs/parallelism.md)."""
    p, t = cfg.parallel, cfg.train
    if not p.distributed_optimizer:
        raise ConfigError("parallel.fsdp=true shards the distributed optimizer's buckets; set "
                          "parallel.distributed_optimizer=true or parallel.fsdp=false")
    if t.precision == "fp8":
        _validate_fsdp_fp8(cfg)
    if t.objective == "dpo" and t.precision == "fp8":
        raise ConfigError("parallel.fsdp=true with train.objective=dpo and train.precision=fp8 is not supported yet "
                          "(the sharded frozen reference would re-cast FP8 weights FSDP has freed); use "
                          "train.precision=bf16 or parallel.fsdp=false")


def _validate_fsdp_fp8(cfg) -> None:
    """parallel.fsdp gathers each block's FP8 weights in FP8 (one scale per weight, 16-aligned shapes:
    mmtrain/model/fp8_fsdp.py); the BF16 values are never whole for a re-cast."""
    f, m, tp = cfg.fp8, cfg.model, cfg.parallel.tp
    if f.backend == "te":
        raise ConfigError("parallel.fsdp=true with train.precision=fp8 needs fp8.backend=native or auto (Transformer "
                          "Engine keeps its own FP8 weights); set fp8.backend=native or parallel.fsdp=false")
    if f.recipe not in ("tensorwise", "delayed"):
        raise ConfigError(f"parallel.fsdp=true gathers FP8 weights with one scale per weight: fp8.recipe must be "
                          f"tensorwise or delayed (got {f.recipe}); or set parallel.fsdp=false")
    head_dim = m.attention_head_dim
    sizes = {"model.hidden_size": m.hidden_size,
             "model.num_attention_heads x head dim / parallel.tp": m.num_attention_heads * head_dim // tp,
             "(model.num_attention_heads + 2 x model.num_query_groups) x head dim / parallel.tp":
                 (m.num_attention_heads + 2 * m.kv_heads) * head_dim // tp}
    if not all(m.moe_layer(i) for i in range(m.num_layers)):  # some layer has a dense MLP
        sizes["model.ffn_hidden_size / parallel.tp"] = m.ffn_hidden_size // tp
    for what, n in sizes.items():
        if n % 16:
            raise ConfigError(f"parallel.fsdp=true with train.precision=fp8 gathers the blocks' FP8 weights in FP8, "
                              f"which needs every FP8 weight dimension a multiple of 16: {what} is {n}; change "
                              "the shape, or use parallel.fsdp=false or train.precision=bf16")


def _check_model_shape(m: ModelConfig, p, mk: str):
    """The chosen family's shape against itself and the layout (the family's ``check`` / ``check_layout``,
    context parallelism where it has none), and every other family's fields left at their defaults, so a value
    put there by mistake is not silently ignored. Returns (the shape, the prefix of its keys)."""
    if m.family not in family_names():
        raise ConfigError(unknown_family_message(m.family, f"{mk}.family"))
    sk = m.shape_prefix(mk)
    for other in family_names():
        if other == m.family:
            continue
        defaults = section_fields(ModelConfig(), other)
        for key, value in section_fields(m, other).items():
            if value != defaults[key]:
                raise ConfigError(f"{mk}.{key}={value!r} belongs to model family {other} but {mk}.family="
                                  f"{m.family} ignores it; set the shape under {sk.rstrip('.')} instead, or "
                                  f"{mk}.family={other}")
    shape = m.shape().check(prefix=sk)
    if p.cp > 1 and not shape.supports_cp:
        raise ConfigError(f"parallel.cp={p.cp} is not supported for {mk}.family={m.family} yet (it is for "
                          f"{', '.join(families_with('supports_cp'))}); use parallel.tp, parallel.pp, parallel.ep "
                          "and data parallelism")
    shape.check_layout(p, prefix=sk)
    return shape, sk


def _validate_lora(cfg, lora, mk: str) -> None:
    allowed = cfg.model.shape().lora_targets()
    bad = [x for x in lora.targets if x not in allowed]
    if bad:
        raise ConfigError(f"peft.lora.targets: {bad[0]} is not a linear of this model ({mk}.family="
                          f"{cfg.model.family}); choose from {', '.join(allowed)} (or leave targets empty for all of "
                          "them)")
    if cfg.train.precision == "fp8":
        raise ConfigError("peft.lora with train.precision=fp8 is not supported; use bf16")


def _validate_data(d) -> None:
    """Data keys that can be checked without opening any file (files are checked when the data is built)."""
    from mmtrain.data.splits import SplitError, parse_split  # numpy only

    try:
        parse_split(d.split)
    except SplitError as exc:
        raise ConfigError(str(exc)) from None
    if d.type in ("sft", "preference"):
        if d.mock or d.blend or not d.prefixes:
            raise ConfigError(f"data.type={d.type} reads data.prefixes (outputs of mmtrain-prep sft); data.mock and "
                              "data.blend are for data.type=gpt")
        flags = [k for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(d, k)]
        if flags:
            raise ConfigError(f"data.{flags[0]} is for data.type=gpt; data.type=sft always keeps attention, positions "
                              "and loss inside each conversation -- remove it")
    elif not d.sft_pack:
        raise ConfigError("data.sft_pack=false applies to data.type=sft only")
    if d.weights:
        if d.blend:
            raise ConfigError("data.weights applies to data.prefixes; a data.blend spec carries its own weights")
        if len(d.weights) != len(d.prefixes):
            raise ConfigError(f"data.weights has {len(d.weights)} values but data.prefixes has {len(d.prefixes)}")


NATIVE_FP8_RECIPES = ("delayed", "tensorwise", "rowwise")
TE_FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _validate_fp8(cfg, mk: str) -> None:
    """The fp8 section, where the device is not needed (the GPU and TE are checked at start-up:
    ``mmtrain.model.fp8.resolve_fp8_backend``)."""
    f, m, p = cfg.fp8, cfg.model, cfg.parallel
    if f.backend == "native" and f.recipe not in NATIVE_FP8_RECIPES:
        raise ConfigError(f"fp8.recipe={f.recipe} is not offered by fp8.backend=native (it has "
                          f"{', '.join(NATIVE_FP8_RECIPES)}); use fp8.backend=te for {f.recipe}")
    if f.backend == "te" and f.recipe not in TE_FP8_RECIPES:
        raise ConfigError(f"fp8.recipe={f.recipe} is not offered by fp8.backend=te (it has "
                          f"{', '.join(TE_FP8_RECIPES)}); use fp8.backend=native for {f.recipe}")
    if f.recipe in ("rowwise", "blockwise") and f.format != "e4m3":
        raise ConfigError(f"fp8.recipe={f.recipe} scales every operand in E4M3; set fp8.format=e4m3 "
                          f"(got {f.format})")
    if f.bf16_first_layers + f.bf16_last_layers >= m.shape().num_layers:
        raise ConfigError(f"fp8.bf16_first_layers + fp8.bf16_last_layers ({f.bf16_first_layers} + "
                          f"{f.bf16_last_layers}) leave no FP8 layer of {m.shape_prefix(mk)}num_layers="
                          f"{m.shape().num_layers}; "
                          "lower them or use train.precision=bf16")
    if f.output_layer and f.backend == "te":
        raise ConfigError("fp8.output_layer=true is a native-backend option (Transformer Engine keeps the output "
                          "layer in BF16 here); set fp8.backend=native or fp8.output_layer=false")
    if f.param_gather:  # FP8 all-gather of the native FP8 weights' distributed-optimizer shards
        if f.backend == "te":
            raise ConfigError("fp8.param_gather=true needs fp8.backend=native (Transformer Engine keeps its own "
                              "FP8 weights); set fp8.backend=native or fp8.param_gather=false")
        if f.recipe not in ("tensorwise", "delayed"):
            raise ConfigError(f"fp8.param_gather=true needs one scale per weight: fp8.recipe tensorwise or delayed "
                              f"(got fp8.recipe={f.recipe}); or set fp8.param_gather=false")
        if not p.distributed_optimizer:
            raise ConfigError("fp8.param_gather=true gathers the distributed optimizer's shards; set "
                              "parallel.distributed_optimizer=true or fp8.param_gather=false")
    if f.fast_accum_backward and (f.backend == "te" or f.recipe not in ("tensorwise", "delayed")):
        raise ConfigError(f"fp8.fast_accum_backward=true applies to the native backend's tensorwise and delayed "
                          f"recipes (got fp8.backend={f.backend}, fp8.recipe={f.recipe}); set it to false")
    if f.backend == "te" and p.tp > 1 and m.add_bias:
        raise ConfigError(f"fp8.backend=te with parallel.tp > 1 and {mk}.add_bias=true is not supported (the "
                          "row-parallel bias would be summed over TP ranks); use fp8.backend=native")
