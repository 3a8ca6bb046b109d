"""GPT training throughput with mmtrain's own engine, one JSON line per run.

    python bench/train_gpt.py [--model configs/models/llama3.2-1b.yaml] [--batch 4] [--seq 4096] [key=value ...]
    python bench/train_gpt.py --data PREFIX --packed            # real prepped tokens, packed documents
    python bench/train_gpt.py --mock-doc-mean 650 --packed       # mock tokens, ~650-token documents
    torchrun --nproc_per_node 2 bench/train_gpt.py parallel.tp=2 parallel.sequence_parallel=true

Runs the real training loop (``mmtrain.train.loop.train_gpt``) for warmup + timed steps and reports the median
timed step (``logging.log_every=1``; the loop times each step with CUDA events, from the end of the step before
it, so a step's time is its device time plus any wait for the host): tokens/s per GPU, model TFLOP/s per GPU
(6N + causal attention, the anchors' formula), MFU against the measured H200 bf16 ceiling (736 TFLOP/s), peak
memory. Compare with ../shared/bench anchors in the same call.

Data: mock tokens by default (no documents: the EOD token only by chance); ``--data PREFIX`` reads
``mmtrain-prep text`` output; ``--mock-doc-mean N`` makes mock samples of documents with geometric lengths of
mean N tokens. ``--packed`` turns on the packed-document keys (positions restart, attention stays inside each
document, the loss skips EOD inputs); ``train.document_attention=dense`` is the S×S-mask reference.

With documents, ``doc_attention_fraction`` is the attention work a document mask leaves, Σ len² / S² over the
timed samples, and ``doc_tflops`` the FLOPs actually done: 6N + that fraction of the causal attention term
(``model_tflops`` keeps the standard 6N + causal figure, so runs stay comparable; ``doc_mfu`` is honest MFU);
``timed_steps_ms_fraction`` pairs each timed step's ms with its own batch's fraction (does the time follow it?).
``--losses-csv FILE`` writes step,loss for loss-curve comparisons. ``--profile FILE`` records the last two
timed steps with torch.profiler (CUDA kernels only) and writes where their time goes (bench/profile_summary.py:
matmuls, attention, norms/elementwise, optimizer, communication, host gap) as markdown; the tokens/s then come
from the other timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.profile_summary import host_profiling, profiling, summarize  # noqa: E402
from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.data.documents import packed_document_inputs  # noqa: E402
from mmtrain.models.registry import model_family  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed  # noqa: E402
from mmtrain.train.loop import train_gpt  # noqa: E402
from mmtrain.utils.atomic import atomic_write_text  # noqa: E402
from mmtrain.utils.log import setup_logging  # noqa: E402

BF16_CEILING_TFLOPS = 736.0
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]


def _mock_documents(mean_length: int):
    """A ``MockGPTSamples.__getitem__`` whose samples hold documents of geometric lengths (mean ``mean_length``)."""

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.randint(1, self.vocab_size, (self.seq_length + 1,), generator=g)
        tokens[torch.rand(self.seq_length + 1, generator=g) < 1.0 / mean_length] = self.eod_id
        return tokens
    return sample


def _samples_for(cfg: GPTRunConfig):
    """The training samples the run read (same construction as the loop's), for the document statistics."""
    if cfg.data.mock:
        from mmtrain.data.mock import MockGPTSamples

        return MockGPTSamples(cfg.model.shape().vocab_size, cfg.data.seq_length, cfg.data.seed)
    from mmtrain.data.blend import build_gpt_samples_from_config

    return build_gpt_samples_from_config(cfg, "train", 1)


def document_attention_fraction(samples, first: int, count: int, seq: int) -> tuple[float, float]:
    """(Σ len² / S² averaged over samples ``first .. first+count``, mean document length) under the EOD rule."""
    eod = getattr(samples, "eod_id", None)
    if eod is None:
        return 1.0, float(seq)
    fractions, lengths = [], []
    for i in range(first, first + count):
        tokens = torch.as_tensor(samples[i], dtype=torch.int64)[None]
        _, doc_ids, _ = packed_document_inputs(tokens, eod, False, True, False)
        counts = torch.bincount(doc_ids[0]).double()
        counts = counts[counts > 0]
        fractions.append(float((counts ** 2).sum() / seq ** 2))
        lengths.extend(counts.tolist())
    return statistics.fmean(fractions), statistics.fmean(lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size per data-parallel rank")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--label", default="mmtrain")
    ap.add_argument("--data", help="indexed-dataset prefix from mmtrain-prep text (default: mock tokens)")
    ap.add_argument("--mock-doc-mean", type=int, default=0, help="mock samples of documents of this mean length")
    ap.add_argument("--packed", action="store_true", help="packed documents: " + " ".join(PACKED))
    ap.add_argument("--print-losses", action="store_true", help="also print every step's loss (parity checks)")
    ap.add_argument("--losses-csv", help="write step,loss of every step to this file")
    ap.add_argument("--profile", help="write the last two timed steps' profile summary (markdown) to this file")
    ap.add_argument("--host-profile", help="write a cProfile table of the first two steps after warmup to this "
                    "file (where the host's time goes; those steps are left out of the timing)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = ["data.mock=true"] if not a.data else ["data.mock=false", f"data.prefixes=[{a.data}]", "data.split=100,0,0"]
    if a.mock_doc_mean:
        from mmtrain.data.mock import MockGPTSamples

        MockGPTSamples.__getitem__ = _mock_documents(a.mock_doc_mean)  # this benchmark process only
    cfg = load_config(GPTRunConfig, a.model, [
        *data, f"data.seq_length={a.seq}", f"train.micro_batch_size={a.batch}",
        f"train.steps={a.steps + a.warmup}", "train.precision=bf16", "optim.warmup_steps=1", "optim.lr=1e-4",
        "logging.run_dir=/tmp/mmtrain-bench", "logging.log_every=1", "checkpoint.save_final=false",
        *(PACKED if a.packed else []), *a.overrides])
    validate_gpt_config(cfg, world)
    device = pick_device(cfg.train.device)
    rank, world = init_distributed(cfg.parallel.backend, device)
    setup_logging(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = ParallelDims.from_config(cfg.parallel, world).build()
    profiled = 2 if a.profile else 0
    hosted = 2 if a.host_profile else 0
    with (profiling(a.warmup + a.steps - profiled, profiled) as prof,
          host_profiling(a.warmup, hosted, a.host_profile)):
        result = train_gpt(cfg, mesh, device)
    timed = result.step_times[a.warmup + hosted:len(result.step_times) - profiled]
    dt = statistics.median(timed)
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * mesh.dims.dp
    S = cfg.data.seq_length
    tps = gbs * S / dt / world
    flops = model_family(cfg.model).flops_per_token
    per_token = flops(cfg.model, S)  # the family's own count (6N + attention)
    causal_attention = per_token - flops(cfg.model, 0)  # its causal term (linear in S; --packed rows)
    tflops = tps * per_token / 1e12
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    row = {"system": a.label, "layout": mesh.dims.describe(), "overrides": a.overrides,
           "data": a.data or (f"mock, documents of mean {a.mock_doc_mean}" if a.mock_doc_mean else "mock"),
           "packed": a.packed, "seq": f"{a.batch}x{S}",
           "tokens_per_s": round(tps), "step_ms": round(1000 * dt, 1), "model_tflops": round(tflops, 1),
           "mfu": round(tflops / BF16_CEILING_TFLOPS, 3), "peak_mem_gib": round(mem, 1),
           "loss": round(result.losses[-1], 4)}
    if a.packed:
        timed = a.warmup * gbs
        samples = _samples_for(cfg)
        fraction, mean_len = document_attention_fraction(samples, timed, min(a.steps * gbs, 64), S)
        doc_tflops = tps * (per_token - causal_attention * (1.0 - fraction)) / 1e12
        row.update({"mean_doc_tokens": round(mean_len, 1), "doc_attention_fraction": round(fraction, 4),
                    "doc_tflops": round(doc_tflops, 1), "doc_mfu": round(doc_tflops / BF16_CEILING_TFLOPS, 3)})
        # each timed step's ms beside its own batch's attention fraction (step i reads samples i*gbs..): whether
        # the packed row's time follows its documents from step to step (issue #32's packed row)
        first = a.warmup + hosted
        row["timed_steps_ms_fraction"] = [
            [round(1000 * t, 1), round(document_attention_fraction(samples, (first + i) * gbs, gbs, S)[0], 4)]
            for i, t in enumerate(result.step_times[first:len(result.step_times) - profiled])]
    if a.print_losses:
        row["losses"] = result.losses
    if rank == 0 and prof is not None:
        wall = statistics.fmean(result.step_times[-profiled:]) * 1000
        title = f"## {a.label}: {a.batch}x{S} {' '.join(a.overrides)} ({row['tokens_per_s']} tokens/s)\n\n"
        atomic_write_text(Path(a.profile), title + summarize(prof, profiled, wall))
    if rank == 0:
        print(json.dumps(row), flush=True)
        if a.losses_csv:
            atomic_write_text(Path(a.losses_csv), "step,loss\n" + "".join(
                f"{i + 1},{loss:.6f}\n" for i, loss in enumerate(result.losses)))
    shutdown_distributed()


if __name__ == "__main__":
    main()
