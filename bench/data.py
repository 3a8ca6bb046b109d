"""Benchmark GPT sample indexing and loading against Megatron-Core's GPTDataset on the same files.

    python bench/data.py [--tokens 1e9] [--docs 1e6] [--seq-length 2048] [--epochs 1] [--out /tmp/bench-data]

Writes a synthetic indexed dataset (``--tokens`` tokens in ``--docs`` documents of exponentially distributed
length, uint16 ids) with ``IndexedDatasetWriter`` under ``--out`` (outside the repository; reused when it
already holds one of the same size), then, interleaved per repeat so both see the same machine load:

(a) index build: mmtrain's ``GPTSamples`` (numba) and Megatron-Core's ``GPTDataset`` (its compiled C++
    helpers), each into a fresh cache folder, for ``epochs * tokens / seq_length`` samples; the two sets of
    arrays are compared for equality;
(b) loading: random-access samples/s over the built indices (``samples[i]`` for mmtrain, Megatron's
    ``_query_document_sample_shuffle_indices``), and mmtrain's ``MicroBatches`` (int64 tensors).

Numba compiles on first use and caches the machine code; that one-time cost is measured and shown apart.
``uptime`` load averages are printed with the table.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.core.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402

_DOCS_PER_CHUNK = 1 << 16


def write_synthetic(prefix: Path, tokens: int, docs: int, seed: int = 0) -> float:
    """The dataset at ``prefix`` (reused if it has the same counts); returns seconds spent writing."""
    try:
        ds = IndexedDataset(prefix)
        if len(ds) == docs and ds.num_tokens == tokens:
            return 0.0
    except Exception:  # noqa: BLE001 - absent or different: rewrite
        pass
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    weights = rng.exponential(size=docs)
    lengths = (np.floor(weights / weights.sum() * (tokens - docs)) + 1).astype(np.int64)
    lengths[-1] += tokens - lengths.sum()
    lengths = lengths.astype(np.int32)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for start in range(0, docs, _DOCS_PER_CHUNK):
            chunk = lengths[start:start + _DOCS_PER_CHUNK]
            w.add(rng.integers(1, 32000, size=int(chunk.sum()), dtype=np.uint16), chunk)
        w.commit()
    return time.perf_counter() - started


class _Tok:  # what Megatron's GPTDatasetConfig reads from a tokenizer
    eod, pad, vocab_size, unique_identifiers = 0, -1, 32000, {"class": "BenchTokenizer"}


def build_megatron(prefix: Path, seq_length: int, num_samples: int, seed: int, cache: Path):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, split="1", tokenizer=_Tok(),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                           create_attention_mask=False, path_to_cache=str(cache))
    started = time.perf_counter()
    low = MegatronIndexed(str(prefix))
    ds = GPTDataset(low, str(prefix), np.arange(len(low), dtype=np.int32), num_samples, Split.train, cfg)
    return ds, time.perf_counter() - started


def build_ours(prefix: Path, seq_length: int, num_samples: int, seed: int, cache: Path):
    from mmtrain.data.gpt_dataset import GPTSamples

    started = time.perf_counter()
    ds = GPTSamples(prefix, seq_length, seed, num_samples, cache_dir=cache)
    return ds, time.perf_counter() - started


def numba_first_use(tmp: Path) -> float:
    """Compile (or load from numba's cache) the kernels on a tiny dataset; seconds taken."""
    from mmtrain.data.gpt_dataset import GPTSamples
    from mmtrain.data.gpt_indices import build_blend_index

    write_synthetic(tmp / "tiny", 10_000, 100)
    started = time.perf_counter()
    s = GPTSamples(tmp / "tiny", 64, 0, 10, cache_dir=tmp / "tiny-cache")
    s[0]
    build_blend_index([1.0, 2.0], 10)
    return time.perf_counter() - started


def access_rate(get, n_samples: int, count: int, seed: int = 1) -> float:
    order = np.random.default_rng(seed).integers(0, n_samples, size=count)
    started = time.perf_counter()
    for i in order:
        get(int(i))
    return count / (time.perf_counter() - started)


def microbatch_rate(samples, count: int, mbs: int = 8) -> float:
    from mmtrain.data.loader import MicroBatches

    batches = MicroBatches(samples, mbs, 0, 1, consumed_samples=len(samples) // 3)
    started = time.perf_counter()
    for _ in range(count // mbs):
        batches.next()
    return (count // mbs) * mbs / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--docs", type=float, default=1e6)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=float, default=1.0, help="samples = epochs * tokens / seq_length")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--access", type=int, default=20000, help="random accesses per loader measurement")
    p.add_argument("--out", default="/tmp/bench-data", help="folder for the synthetic data (outside the repo)")
    args = p.parse_args(argv)
    tokens, docs = int(args.tokens), int(args.docs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / f"synthetic_{tokens}_{docs}"
    write_s = write_synthetic(prefix, tokens, docs)
    num_samples = int(args.epochs * tokens // args.seq_length)
    compile_s = numba_first_use(out)

    rows: dict[str, list[float]] = {"mmtrain": [], "megatron-core": []}
    equal = True
    ours = theirs = None
    for _ in range(args.repeats):
        for name, build in (("mmtrain", build_ours), ("megatron-core", build_megatron)):
            cache = Path(tempfile.mkdtemp(prefix=f"cache-{name}-", dir=out))
            try:
                ds, seconds = build(prefix, args.seq_length, num_samples, args.seed, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)  # arrays stay usable: memory maps outlive the unlink
            rows[name].append(seconds)
            if name == "mmtrain":
                ours = ds
            else:
                theirs = ds
        equal &= all(np.array_equal(getattr(ours, a), getattr(theirs, a))
                     for a in ("document_index", "sample_index", "shuffle_index"))

    n = len(ours)
    ours_rate = access_rate(ours.__getitem__, n, args.access)
    theirs_rate = access_rate(theirs._query_document_sample_shuffle_indices, n, args.access)
    mb_rate = microbatch_rate(ours, args.access)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    print(f"\ndata: {tokens:,} tokens, {docs:,} documents ({prefix}, written in {write_s:.1f} s"
          f"{'; reused' if write_s == 0 else ''}); seq_length {args.seq_length}, {num_samples:,} samples requested, "
          f"{n:,} indexed; numba first use {compile_s:.2f} s (one time, cached)")
    print(f"indices equal to Megatron-Core's: {equal}")
    print(f"{'':<16}{'index build s (best / all)':>30}{'random samples/s':>20}")
    print(f"{'mmtrain':<16}{min(rows['mmtrain']):>12.3f} / {', '.join(f'{s:.3f}' for s in rows['mmtrain']):<15}"
          f"{ours_rate:>20,.0f}")
    print(f"{'megatron-core':<16}{min(rows['megatron-core']):>12.3f} / "
          f"{', '.join(f'{s:.3f}' for s in rows['megatron-core']):<15}{theirs_rate:>20,.0f}")
    print(f"{'ratio':<16}{min(rows['megatron-core']) / min(rows['mmtrain']):>12.2f}x faster{'':<10}"
          f"{ours_rate / theirs_rate:>18.2f}x")
    print(f"mmtrain MicroBatches (mbs 8, int64 tensors): {mb_rate:,.0f} samples/s")
    print(f"load: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
