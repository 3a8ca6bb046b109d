"""Loss and perplexity of a checkpoint over a dataset split, on any TP/PP/DP layout.

    python -m mmtrain.evaluate --ckpt CKPT --data PREFIX [--split valid] [--seq-length N] [--batch-size B]
        [--max-samples N] [--output F.json]
    torchrun --nproc_per_node 4 -m mmtrain.evaluate --tp 2 --pp 2 --ckpt CKPT --data BLEND.yaml

``--data`` is an indexed prefix (``PREFIX.bin/.idx``) or a blend-spec file (docs/blend-spec.md); the split's
documents come from ``--data-split`` (default: the ``data.split`` the checkpoint was trained with), the samples
from the trainer's own sample builder (``seq_length + 1`` tokens across documents), so a run's validation loss
and this command's agree on the same samples. By default every token of the split is scored once (one pass);
``--max-samples`` scores a random subset of that size (the dataset's shuffled order). The checkpoint is read
weights-only (any training layout, or a converted one); the layout here is ``--tp`` x ``--pp`` x the rest of the
world as data parallelism. The loss is the mean token cross-entropy (nats), perplexity ``exp(loss)``.
Data prepared with another tokenizer than the checkpoint's (``mmtrain.core.tokenizer_record``) is refused unless
``--allow-other-tokenizer``. Rank 0 reports progress on stderr (a line per tenth of the samples).
Bad input is one line on stderr and exit status 2. ``--help`` and a missing ``--ckpt`` or ``--data`` answer
before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmtrain.config import ConfigError, GPTRunConfig, validate_gpt_config
from mmtrain.config.loader import apply_mapping
from mmtrain.parallel import LayoutError, ParallelDims

if TYPE_CHECKING:
    import torch

# the data settings of the checkpoint's run that shape its samples and its loss
_RUN_DATA_KEYS = ("seq_length", "split", "seed", "reset_position_ids", "reset_attention_mask", "eod_mask_loss")
_MICRO_BATCHES_PER_CALL = 16  # micro-batches per forward-only schedule (pipeline fill amortized, bounded memory)


@dataclass
class EvalResult:
    """One evaluation: samples and loss tokens scored, mean token loss (nats) and its perplexity."""

    split: str
    samples: int
    tokens: int
    loss: float
    perplexity: float


def eval_run_config(ckpt: str | Path, data: str, *, seq_length: int | None = None, batch_size: int = 4,
                    tp: int = 1, pp: int = 1, precision: str = "fp32", data_split: str | None = None,
                    device: str = "auto") -> GPTRunConfig:
    """The run config an evaluation builds its model and samples from: the checkpoint's model, the data settings
    it trained with (sequence length, split, seed, packed-document flags; each overridable), ``data`` as a
    prefix or a blend-spec file, and this evaluation's layout and precision."""
    from mmtrain.convert.checkpoint_io import checkpoint_lora
    from mmtrain.inference.loading import checkpoint_config

    model_cfg, meta = checkpoint_config(ckpt)  # a quantized folder too (docs/quantization.md)
    cfg = GPTRunConfig(model=model_cfg)
    lora = checkpoint_lora(meta, ckpt)  # a LoRA run's checkpoint: the stage is built with its adapters
    if lora is not None:
        cfg.peft.lora = lora
    run = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    recorded = run.get("data") if isinstance(run.get("data"), dict) else {}
    apply_mapping(cfg.data, {k: recorded[k] for k in _RUN_DATA_KEYS if k in recorded},
                  f"{ckpt} complete.json data config", root_cls=GPTRunConfig, prefix="data.")
    if seq_length is not None:
        cfg.data.seq_length = seq_length
    if data_split is not None:
        cfg.data.split = data_split
    if Path(data).suffix in (".yaml", ".yml", ".json"):
        cfg.data.blend = data
    else:
        cfg.data.prefixes = [data]
    cfg.parallel.tp, cfg.parallel.pp = tp, pp
    cfg.train.micro_batch_size, cfg.train.precision, cfg.train.device = batch_size, precision, device
    return cfg


def _dtype(precision: str) -> torch.dtype:
    import torch

    return torch.float32 if precision == "fp32" else torch.bfloat16


def load_eval_stage(cfg: GPTRunConfig, mesh, device: torch.device, ckpt: str | Path) -> torch.nn.Module:
    """This rank's stage of the checkpoint's model (TP/PP per ``mesh``), its weights read from ``ckpt`` (a LoRA
    run's adapters too, merged into the base weights), in eval mode and the evaluation's precision."""
    from mmtrain.convert.checkpoint_io import load_model_weights
    from mmtrain.inference.quantized_loading import is_quantized_folder
    from mmtrain.model.lora import merge_adapters
    from mmtrain.train.build import build_gpt_stage

    if is_quantized_folder(ckpt):
        return _quantized_stage(cfg, mesh, device, ckpt)
    stage = build_gpt_stage(cfg, mesh, device)
    # into the fp32 stage: the stored dtype is cast on the way in
    load_model_weights(ckpt, mesh, stage, adapters=bool(cfg.peft.lora.rank))
    merge_adapters(stage)
    return stage.to(_dtype(cfg.train.precision)).eval()


def _quantized_stage(cfg: GPTRunConfig, mesh, device: torch.device, ckpt: str | Path) -> torch.nn.Module:
    """A quantized folder's whole model (``mmtrain.inference.quantized_loading``) on ``device``: its parameters in
    the evaluation's precision, its quantized weights and scales as stored; data parallel only."""
    from mmtrain.inference.quantized_loading import load_quantized_model, use_quantized_kernels

    if mesh.dims.tp > 1 or mesh.dims.pp > 1:
        raise ConfigError(f"--ckpt {ckpt} is a quantized folder: it is evaluated whole on each rank (--tp 1 --pp 1)")
    model, _ = load_quantized_model(ckpt)
    model.to(device)
    for p in model.parameters():  # not Module.to(dtype): that would cast the FP8 weights and the scales too
        p.data = p.data.to(_dtype(cfg.train.precision))
    use_quantized_kernels(model)
    return model.eval()


Progress = Callable[[int, int], None]  # (samples scored so far, samples in all)


def evaluate_samples(stage: torch.nn.Module, samples, num_samples: int, cfg: GPTRunConfig, mesh,
                     device: torch.device, eod_id: int | None = None,
                     progress: Progress | None = None) -> torch.Tensor:
    """[sum of token losses, loss tokens] (float64, on every rank) over samples ``0 .. num_samples - 1``.
    Global batch ``m`` holds ``mbs * dp`` consecutive samples, data-parallel rank ``r`` the slice ``r * mbs``
    onward; the last batch is padded with sample 0 under a zero row mask, so every rank runs the same shapes.
    ``progress`` is called after each group of micro-batches with the samples scored over all ranks."""
    import torch

    from mmtrain.data.documents import DocumentRule
    from mmtrain.train.loop import reduce_loss_stats, run_micro_batches

    documents = DocumentRule.from_config(cfg.data, eod_id)  # packed documents, as the trainer's loader hands them
    mbs, dp, r = cfg.train.micro_batch_size, mesh.dims.dp, mesh.coord.dp
    batches = math.ceil(num_samples / (mbs * dp))
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    if progress is not None:
        progress(0, num_samples)
    with torch.no_grad():
        for first in range(0, batches, _MICRO_BATCHES_PER_CALL):
            micro, masks = [], []
            last = min(first + _MICRO_BATCHES_PER_CALL, batches)
            for m in range(first, last):
                index = [m * mbs * dp + r * mbs + j for j in range(mbs)]
                tokens = torch.stack([torch.as_tensor(samples[i if i < num_samples else 0], dtype=torch.int64)
                                      for i in index])
                micro.append(documents.apply(tokens) if documents is not None else tokens)
                masks.append(torch.tensor([1.0 if i < num_samples else 0.0 for i in index]))
            stats += run_micro_batches(stage, micro, mesh, cfg, device, None, row_masks=masks)
            if progress is not None:
                progress(min(num_samples, last * mbs * dp), num_samples)
        return reduce_loss_stats(stats, mesh)


def evaluate_checkpoint(cfg: GPTRunConfig, mesh, device: torch.device, ckpt: str | Path, split: str = "valid",
                        max_samples: int | None = None, progress: Progress | None = None) -> EvalResult:
    """Score ``ckpt`` on ``split`` of ``cfg.data`` (see the module docstring); collective over the mesh.
    ``progress``: see ``evaluate_samples``."""
    from mmtrain.data.blend import build_gpt_samples_from_config, split_samples_per_pass

    num = split_samples_per_pass(cfg, split)
    if max_samples is not None:
        num = min(num, max_samples)
    samples = build_gpt_samples_from_config(cfg, split, mesh.dims.dp, index_builder=mesh.node_local_rank == 0,
                                            num_samples=num)
    stage = load_eval_stage(cfg, mesh, device, ckpt)
    total, tokens = evaluate_samples(stage, samples, num, cfg, mesh, device, samples.eod_id, progress).tolist()
    loss = total / tokens
    return EvalResult(split, num, int(tokens), loss, math.exp(loss) if loss < 700 else float("inf"))


def format_table(result: EvalResult) -> str:
    head = f"{'split':<8} {'samples':>8} {'tokens':>12} {'loss':>10} {'perplexity':>12}"
    row = (f"{result.split:<8} {result.samples:>8} {result.tokens:>12} {result.loss:>10.4f} "
           f"{result.perplexity:>12.3f}")
    return head + "\n" + row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mmtrain.evaluate",
                                 description="Loss and perplexity of a checkpoint over a dataset split "
                                             "(docs/evaluate.md).")
    ap.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    ap.add_argument("--data", required=True, help="indexed dataset PREFIX (PREFIX.bin/.idx) or a blend-spec .yaml")
    ap.add_argument("--split", default="valid", choices=("train", "valid", "test"), help="which split to score")
    ap.add_argument("--data-split", default=None,
                    help="document split weights like 969,30,1 (default: the checkpoint's data.split)")
    ap.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default: the checkpoint's)")
    ap.add_argument("--batch-size", type=int, default=4, help="samples per forward per data-parallel rank")
    ap.add_argument("--max-samples", type=int, default=None,
                    help="score at most this many samples (a random subset; default: the whole split once)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the rest of the world is DP)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="compute precision (default bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--output", default=None, help="also write the result as JSON to this file")
    ap.add_argument("--allow-other-tokenizer", action="store_true",
                    help="score data prepared with another tokenizer than the checkpoint's (refused by default: "
                         "the ids fit, the loss is meaningless)")
    return ap


def _check_args(args) -> None:
    """The checks that need no torch: numbers, the output folder, and that --ckpt and --data exist."""
    for name in ("seq_length", "batch_size", "max_samples", "tp", "pp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value}: must be >= 1")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise ConfigError(f"--output {args.output}: its folder does not exist")
    if not Path(args.ckpt).exists():
        raise ConfigError(f"--ckpt {args.ckpt}: not found (looked for {Path(args.ckpt).resolve()}); give a "
                          "checkpoint step folder or a checkpoints root with `latest`")
    if Path(args.data).suffix in (".yaml", ".yml", ".json"):
        if not Path(args.data).is_file():
            raise ConfigError(f"--data {args.data}: blend spec not found (looked for {Path(args.data).resolve()})")
        return
    missing = [p for p in (f"{args.data}.idx", f"{args.data}.bin") if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"--data {args.data}: indexed dataset not found (missing {', '.join(missing)}); give "
                          "the prefix without .bin/.idx (mmtrain-prep text writes them) or a blend-spec .yaml")


def check_data_tokenizer(cfg: GPTRunConfig, ckpt: str | Path, data: str, allow_other: bool = False) -> str | None:
    """Refuse (``ConfigError``) evaluation data prepared with another tokenizer than the one the checkpoint's
    model was trained with (``mmtrain.core.tokenizer_record``), unless ``allow_other``. Returns a warning line
    when it cannot be checked: the data's manifests name a tokenizer, the checkpoint none."""
    from mmtrain.core.tokenizer_record import checkpoint_tokenizer_record, describe_record, tokenizer_mismatch
    from mmtrain.data.blend import data_tokenizer
    from mmtrain.inference.loading import checkpoint_config

    data_tok = data_tokenizer(cfg)
    if data_tok is None:  # no manifest names one: nothing to compare
        return None
    meta = checkpoint_config(ckpt)[1]
    if checkpoint_tokenizer_record(meta) is None:
        return (f"warning: {ckpt} names no tokenizer (converted without one, or saved before checkpoints recorded "
                f"it): cannot check that --data {data} was prepared with the model's tokenizer")
    found = None if allow_other else tokenizer_mismatch(meta, data_tok)
    if found is None:
        return None
    ckpt_tok, where = found
    raise ConfigError(f"--data {data} was prepared with {describe_record(data_tok)}, but {ckpt}'s model was "
                      f"trained with {describe_record(ckpt_tok)} (from its {where}): the loss would be meaningless; "
                      "evaluate data prepared with the model's tokenizer, or pass --allow-other-tokenizer if this "
                      "is intended")


class _ProgressLines:
    """Rank 0's progress on stderr: a line when scoring starts, then one per tenth of the samples scored (by
    count, not by time: a long evaluation shows it is moving, a short one prints two lines)."""

    def __init__(self, prog: str, split: str, seq_length: int) -> None:
        self.prog, self.split, self.seq_length, self.shown = prog, split, seq_length, 0

    def __call__(self, done: int, total: int) -> None:
        if done == 0:
            print(f"{self.prog}: scoring {total} samples of {self.seq_length + 1} tokens ({self.split} split)",
                  file=sys.stderr, flush=True)
            return
        tenth = done * 10 // total
        if tenth > self.shown:
            self.shown = tenth
            print(f"{self.prog}: scored {done}/{total} samples ({100 * done // total}%)", file=sys.stderr,
                  flush=True)


def _errors() -> tuple[type[BaseException], ...]:
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.core.indexed import IndexedFormatError
    from mmtrain.core.manifest import ManifestError
    from mmtrain.data.blend_spec import BlendSpecError
    from mmtrain.data.index_cache import IndexCacheTimeout
    from mmtrain.data.splits import SplitError
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    return (ConfigError, LayoutError, ConvertError, BlendSpecError, SplitError, IndexedFormatError, ManifestError,
            IndexCacheTimeout, CheckpointFormatError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    prog = "mmtrain.evaluate"
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _check_args(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from mmtrain.parallel import init_distributed, pick_device, shutdown_distributed  # torch from here on

    errors = _errors()
    first_process = int(os.environ.get("RANK", "0")) == 0
    try:
        try:
            device = pick_device(args.device)
        except RuntimeError:  # pick_device's one refusal
            raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu or auto") from None
        precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
        cfg = eval_run_config(args.ckpt, args.data, seq_length=args.seq_length, batch_size=args.batch_size,
                              tp=args.tp, pp=args.pp, precision=precision, data_split=args.data_split,
                              device=args.device)
        validate_gpt_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        warning = check_data_tokenizer(cfg, args.ckpt, args.data, args.allow_other_tokenizer)
    except errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if warning and first_process:
        print(f"{prog}: {warning}", file=sys.stderr, flush=True)
    rank, world = init_distributed("auto", device)
    try:
        mesh = ParallelDims.from_config(cfg.parallel, world).build()
        progress = _ProgressLines(prog, args.split, cfg.data.seq_length) if rank == 0 else None
        result = evaluate_checkpoint(cfg, mesh, device, args.ckpt, args.split, args.max_samples, progress)
    except errors as exc:
        print(f"{'' if rank == 0 else f'[rank {rank}] '}{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown_distributed()
    if rank == 0:
        print(format_table(result), flush=True)
        if args.output:
            from mmtrain.utils.atomic import atomic_write_text

            report: dict[str, Any] = {"ckpt": str(args.ckpt), "data": args.data, "seq_length": cfg.data.seq_length,
                                      "data_split": cfg.data.split, "precision": precision,
                                      "layout": {"tp": mesh.dims.tp, "pp": mesh.dims.pp, "dp": mesh.dims.dp},
                                      **asdict(result)}
            atomic_write_text(args.output, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
