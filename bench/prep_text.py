"""Benchmark `mmtrain-prep text` against Megatron-LM's tools/preprocess_data.py on the same input.

    python bench/prep_text.py --megatron /path/to/Megatron-LM [--megatron-pythonpath EXTRA] \\
        [--input corpus.jsonl | --build-mb 110] [--kinds sentencepiece huggingface gpt2-bpe] \\
        [--kind-mb gpt2-bpe=20] [--workers 1 2] [--repeats 3] [--pin-cores] [--parquet] [--skip-megatron]

Both tools run as subprocesses on the same JSONL, the same tokenizer and the same worker count, with
--append-eod, in interleaved rounds (ours, Megatron, ours, Megatron, ...) so both see the same machine load;
medians over the rounds are reported. Tokenizer kinds and what Megatron-LM runs for each:

- ``sentencepiece``: a 32k BPE ``.model`` (``mmtrain-prep train-tokenizer``); Megatron ``GPTSentencePieceTokenizer``.
- ``huggingface``: a 32k byte-level BPE ``tokenizer.json``; Megatron ``HuggingFaceTokenizer`` (transformers).
- ``gpt2-bpe``: the same kind of BPE saved in GPT-2 file format (``vocab.json`` + ``merges.txt``, with
  ``<|endoftext|>``); Megatron ``GPT2BPETokenizer --vocab-file --merge-file``, the GPT data path of its
  documentation. Which code that runs depends on the Megatron-LM version: up to core_v0.16 it has
  ``--legacy-tokenizer``, Megatron's own pure-Python GPT-2 BPE, used here (its default system there builds the
  tokenizer from the hub model "gpt2" and ignores --merge-file). From core_v0.17 on the pure-Python code is
  gone: GPT2BPETokenizer is transformers' ``AutoTokenizer("gpt2", vocab_file=, merges_file=)``, which needs
  the hub; it is run offline by serving the name "gpt2" from a local folder with these files (Megatron's
  working directory), and with transformers 5 it encodes in Rust too. Ours encodes the files with the Rust
  ``tokenizers`` library.

Reported per run: wall time (process start to exit), docs/s, MB/s, tokens/s, CPU seconds of the whole
process tree (os.wait4), peak RSS summed over the process tree (sampled every 50 ms), and whether the two
.bin/.idx pairs are byte-identical (checked every run; a difference is an error). Each round also runs both
tools on the first 20 documents (``--startup-docs``, at the first worker count): that wall time is the
start-up (imports, tokenizer load, pool start); the "steady" ratio divides the run times less their start-ups, the end-to-end ratio does not. ``--pin-cores`` runs each
command under ``taskset`` on as many cores as it has workers (so each side gets the same CPU; our tokenizer
then uses one thread per worker). Load averages are printed with the figures.

``--parquet`` also runs ours on the same documents written as Parquet (one ``text`` column, row groups of
``--parquet-rows`` rows, snappy, pyarrow's defaults otherwise): rows ``ours parquet t=..``, whose MB and MB/s
are those of the JSONL (the same text), and whose ``.bin/.idx`` must be byte-identical to the JSONL run's.
It first prints the CPU seconds of the input side alone (read, hash, parse/convert to strings; no tokenizer),
JSONL against Parquet, measured in this process: what the two paths differ in, where a loaded machine's wall
times cannot tell them apart.

Without --input, a corpus of real text is built from the .py/.md/.rst/.txt files of the running Python
installation, cut into documents with a log-normal length distribution (median ~1 KB, long tail), and
repeated to --build-mb; ``--kind-mb KIND=MB`` runs a kind on the first MB of it only (Megatron's pure-Python
GPT-2 BPE is slow). Tokenizers are trained on a sample of the corpus unless given.
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")


def build_corpus(path: Path, target_mb: float, seed: int = 0) -> Path:
    """Documents cut from the text files of this Python installation, repeated to ``target_mb``."""
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    texts: list[str] = []
    enough = max(2 * target_mb * 1e6, 50e6)  # a big site-packages holds far more text than needed
    gathered = 0
    for root in roots:
        for dirpath, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                if name.endswith(_TEXT_SUFFIXES) and gathered < enough:
                    try:
                        texts.append(Path(dirpath, name).read_text(encoding="utf-8"))
                    except (UnicodeDecodeError, OSError):
                        continue
                    gathered += len(texts[-1])
    rng = random.Random(seed)
    rng.shuffle(texts)
    target = int(target_mb * 1e6)
    written = 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            for text in texts:
                pos = 0
                while pos < len(text) and written < target:
                    size = max(16, int(rng.lognormvariate(7.0, 1.0)))  # median ~1.1k chars, mean ~1.8k
                    chunk = text[pos:pos + size]
                    pos += size
                    if not chunk.strip():
                        continue  # Megatron keeps token-less documents as zero-sequence entries; we skip them
                    line = json.dumps({"text": chunk}, ensure_ascii=False) + "\n"
                    f.write(line)
                    written += len(line.encode("utf-8"))
                if written >= target:
                    break
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=2)
def _train_byte_level_bpe(corpus: Path, vocab_size: int, sample_docs: int):
    """One training serves both the tokenizer.json and the GPT-2 files (the same BPE, two file formats)."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(corpus, encoding="utf-8") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in itertools.islice(f, sample_docs)), trainer)
    return tok


def build_gpt2_files(folder: Path, corpus: Path, vocab_size: int, sample_docs: int = 20000) -> Path:
    """GPT-2-format ``vocab.json`` + ``merges.txt`` (byte-level BPE, ``<|endoftext|>`` in the vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    _train_byte_level_bpe(corpus, vocab_size, sample_docs).model.save(str(folder))
    return folder


def build_hf_tokenizer(folder: Path, corpus: Path, vocab_size: int, sample_docs: int = 20000) -> Path:
    """Byte-level BPE tokenizer.json (+ tokenizer_config.json naming <|endoftext|> as eos), trained locally."""
    folder.mkdir(parents=True, exist_ok=True)
    _train_byte_level_bpe(corpus, vocab_size, sample_docs).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return folder


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))


def corpus_head(corpus: Path, mb: float) -> Path:
    """The first ``mb`` MB of whole lines of ``corpus`` (the corpus itself when it is not larger)."""
    limit = int(mb * 1e6)
    if corpus.stat().st_size <= limit:
        return corpus
    out = corpus.with_name(f"{corpus.stem}_{mb:g}mb.jsonl")
    if not out.exists():
        tmp = out.with_suffix(".partial")
        with open(corpus, "rb") as src, open(tmp, "wb") as dst:
            written = 0
            for line in src:
                if written + len(line) > limit:
                    break
                dst.write(line)
                written += len(line)
        os.replace(tmp, out)
    return out


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants, from /proc (no psutil needed)."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid, resident in rss.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            total += resident
    return total


def run_measured(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, float, str]:
    """Wall seconds, peak RSS (bytes, summed over the process tree, sampled every 50 ms), CPU seconds of the
    tree (user + system, from wait4: every process a parent reaped counts), output tail."""
    import threading

    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    peak = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    out = b"".join(out_chunks).decode("utf-8", "replace")
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return wall, peak, usage.ru_utime + usage.ru_stime, out[-2000:]


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def pin(cmd: list[str], cores: int | None) -> list[str]:
    """``cmd`` under taskset on the first ``cores`` CPUs this process may use (None: unpinned)."""
    if cores is None:
        return cmd
    allowed = sorted(os.sched_getaffinity(0))
    if cores > len(allowed):
        raise SystemExit(f"--pin-cores: {cores} cores asked, {len(allowed)} available")
    return ["taskset", "-c", ",".join(map(str, allowed[:cores]))] + cmd


def parquet_copy(corpus: Path, rows_per_group: int) -> Path:
    """The corpus' ``text`` values as a Parquet file beside it (written once, streamed: memory stays small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = corpus.with_name(f"{corpus.stem}_rg{rows_per_group}.parquet")
    if out.exists():
        return out
    tmp = out.with_suffix(".partial")
    schema = pa.schema([("text", pa.string())])
    with open(corpus, "rb") as src, pq.ParquetWriter(tmp, schema) as writer:
        texts: list[str] = []
        for line in src:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if len(texts) == rows_per_group:
                writer.write_table(pa.table({"text": texts}, schema=schema), row_group_size=rows_per_group)
                texts = []
        if texts:
            writer.write_table(pa.table({"text": texts}, schema=schema), row_group_size=rows_per_group)
    os.replace(tmp, out)
    return out


def input_cost(jsonl: Path, parquet: Path, rounds: int = 3) -> None:
    """CPU seconds of the input side alone (stream, hash, parse to strings), JSONL vs Parquet; medians."""
    sys.path.insert(0, str(REPO))
    import pyarrow  # noqa: F401 - its import is start-up, not input cost
    from dataprep.text_encode import EncodedBlock, parse_records
    from dataprep.text_input import InputFile, split_lines, stream_inputs
    from dataprep.text_tables import TableBlock, table_texts

    def cost(path: Path, kind: str) -> float:
        start = time.process_time()
        for b in stream_inputs([InputFile(path, path.stat().st_size, kind=kind)], ("text",)):
            if isinstance(b, TableBlock):
                table_texts(b, ("text",))
            else:
                parse_records(split_lines(b.data), b.first_line, ("text",), EncodedBlock(0, b.first_line, 0))
        return time.process_time() - start

    size = jsonl.stat().st_size / 1e6
    for kind, path in (("jsonl", jsonl), ("parquet", parquet)):
        cpu = median([cost(path, kind) for _ in range(rounds)])
        print(f"input side only, {kind:7s}: {cpu:6.3f} CPU s for {size:.1f} MB of JSONL text = {size / cpu:7.1f} MB/s "
              f"per core (median of {rounds})", flush=True)


def probe_input(corpus: Path, docs: int) -> Path:
    out = corpus.with_name(f"{corpus.stem}_first{docs}.jsonl")
    if not out.exists():
        with open(corpus, "rb") as src:
            out.write_bytes(b"".join(line for _, line in zip(range(docs), src)))
    return out


def ours_cmd(py: str, data: Path, prefix: Path, tokenizer: Path, workers: int, threads: int) -> list[str]:
    cmd = [py, "-m", "dataprep", "text", "--input", str(data), "--output-prefix", str(prefix),
           "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(workers), "--progress", "never"]
    return cmd + (["--threads-per-worker", str(threads)] if threads else [])


def megatron_cmd(py: str, meg: Path, data: Path, prefix: Path, kind: str, tokenizer: Path, workers: int) -> list[str]:
    legacy = ["--legacy-tokenizer"] if kind == "gpt2-bpe" and megatron_has_legacy_gpt2(meg) else []
    return [py, str(meg / "tools" / "preprocess_data.py"), "--input", str(data), "--output-prefix", str(prefix),
            *MEGATRON_TOKENIZER[kind](tokenizer), *legacy, "--workers", str(workers), "--append-eod",
            "--log-interval", "1000000"]


MEGATRON_TOKENIZER = {
    "sentencepiece": lambda t: ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(t)],
    "huggingface": lambda t: ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(t)],
    "gpt2-bpe": lambda t: ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(t / "vocab.json"),
                           "--merge-file", str(t / "merges.txt")],
}


def megatron_has_legacy_gpt2(meg: Path) -> bool:
    """Megatron-LM up to core_v0.16 keeps its pure-Python GPT-2 BPE behind --legacy-tokenizer."""
    args = meg / "megatron" / "training" / "arguments.py"
    return args.is_file() and "--legacy-tokenizer" in args.read_text(encoding="utf-8") and \
        (meg / "megatron" / "training" / "tokenizer" / "gpt2_tokenization.py").is_file()


def hub_gpt2_folder(work: Path, gpt2_files: Path) -> Path:
    """A working directory whose ``gpt2/`` folder answers transformers' AutoTokenizer("gpt2") offline."""
    import shutil

    home = work / "megatron-cwd"
    folder = home / "gpt2"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_files / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "unk_token": "<|endoftext|>", "add_prefix_space": False}))
    return home


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron", required=True, help="path of a Megatron-LM checkout (has tools/preprocess_data.py)")
    ap.add_argument("--megatron-pythonpath", default="", help="extra PYTHONPATH entries for Megatron-LM's imports")
    ap.add_argument("--input", default=None, help="JSONL to use (default: build one)")
    ap.add_argument("--build-mb", type=float, default=110.0, help="size of the built corpus in MB")
    ap.add_argument("--kind-mb", nargs="*", default=[], metavar="KIND=MB",
                    help="run KIND on the first MB of the corpus only, e.g. gpt2-bpe=20")
    ap.add_argument("--work-dir", default=None, help="where corpus, tokenizers and outputs go (default: a temp dir)")
    ap.add_argument("--tokenizer", default=None, help="SentencePiece .model (default: train a 32k BPE)")
    ap.add_argument("--hf-tokenizer", default=None,
                    help="Hugging Face tokenizer folder (default: train a 32k byte-level BPE); Megatron-LM needs "
                         "`transformers` importable for it (see --megatron-pythonpath)")
    ap.add_argument("--gpt2-files", default=None,
                    help="folder with GPT-2 vocab.json + merges.txt (default: train a 32k byte-level BPE)")
    ap.add_argument("--kinds", nargs="+", choices=tuple(MEGATRON_TOKENIZER), default=["sentencepiece"],
                    help="tokenizer kinds to benchmark")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads-per-worker", type=int, nargs="+", default=[1],
                    help="our tokenizer threads per worker; 1 = the same CPU budget per worker as Megatron, "
                         "0 = our default (CPUs / workers). Several values give one row each")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians are reported")
    ap.add_argument("--pin-cores", action="store_true",
                    help="run each command under taskset on as many cores as it has workers")
    ap.add_argument("--startup-docs", type=int, default=20,
                    help="documents in the start-up probe run of each tool (0: no probe)")
    ap.add_argument("--json-out", default=None, help="also write every run as JSON here")
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument("--parquet", action="store_true",
                    help="also run ours on the corpus as Parquet; outputs must equal the JSONL run's")
    ap.add_argument("--parquet-rows", type=int, default=50_000, help="rows per Parquet row group")
    args = ap.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="prep_text_bench_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    corpus = Path(args.input).resolve() if args.input else work / "corpus.jsonl"
    if not corpus.exists():
        print(f"building {args.build_mb:.0f} MB corpus at {corpus} ...", flush=True)
        build_corpus(corpus, args.build_mb)
    kind_mb = {k: float(v) for k, v in (item.split("=", 1) for item in args.kind_mb)}
    ours_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                                           if p)}
    tokenizers = {}
    if "sentencepiece" in args.kinds:
        tokenizers["sentencepiece"] = Path(args.tokenizer).resolve() if args.tokenizer else work / "sp32k.model"
        if not tokenizers["sentencepiece"].exists():
            print(f"training tokenizer {tokenizers['sentencepiece']} ...", flush=True)
            subprocess.run([py, "-m", "dataprep", "train-tokenizer", "--input", str(corpus), "--output-prefix",
                            str(tokenizers["sentencepiece"].with_suffix("")), "--vocab-size", str(args.vocab_size),
                            "--sample-docs", "20000"], env=ours_env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    if "huggingface" in args.kinds:
        tokenizers["huggingface"] = Path(args.hf_tokenizer).resolve() if args.hf_tokenizer else work / "hf32k"
        if not (tokenizers["huggingface"] / "tokenizer.json").exists():
            print(f"training tokenizer {tokenizers['huggingface']} ...", flush=True)
            build_hf_tokenizer(tokenizers["huggingface"], corpus, args.vocab_size)
    if "gpt2-bpe" in args.kinds:
        tokenizers["gpt2-bpe"] = Path(args.gpt2_files).resolve() if args.gpt2_files else work / "gpt2-32k"
        if not (tokenizers["gpt2-bpe"] / "merges.txt").exists():
            print(f"training tokenizer {tokenizers['gpt2-bpe']} (GPT-2 file format) ...", flush=True)
            build_gpt2_files(tokenizers["gpt2-bpe"], corpus, args.vocab_size)
    meg = Path(args.megatron).resolve()
    meg_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(meg), args.megatron_pythonpath) if p),
               "PYTHONUTF8": "1", "HF_HUB_OFFLINE": "1"}
    meg_cwd = {k: meg for k in tokenizers}
    if "gpt2-bpe" in tokenizers:
        if megatron_has_legacy_gpt2(meg):
            print("Megatron-LM GPT2BPETokenizer: its pure-Python BPE (--legacy-tokenizer)", flush=True)
        else:
            meg_cwd["gpt2-bpe"] = hub_gpt2_folder(work, tokenizers["gpt2-bpe"])
            print("Megatron-LM GPT2BPETokenizer: transformers AutoTokenizer('gpt2') (no pure-Python BPE in this "
                  f"version), served offline from {meg_cwd['gpt2-bpe']}/gpt2", flush=True)
    inputs = {k: corpus_head(corpus, kind_mb[k]) if k in kind_mb else corpus for k in tokenizers}
    stats = {path: (count_lines(path), path.stat().st_size) for path in set(inputs.values())}
    parquet = {path: parquet_copy(path, args.parquet_rows) for path in set(inputs.values())} if args.parquet else {}
    for path, pq_path in parquet.items():
        print(f"parquet copy {pq_path}: {pq_path.stat().st_size / 1e6:.1f} MB", flush=True)
        input_cost(path, pq_path)
    for path, (docs, size) in sorted(stats.items()):
        print(f"input {path}: {docs:,} documents, {size / 1e6:.1f} MB", flush=True)
    print(f"cpus available {len(os.sched_getaffinity(0))}; pinned: {args.pin_cores}; rounds: {args.repeats}",
          flush=True)

    runs: list[dict] = []
    startup: dict[tuple, list[float]] = {}
    for rnd in range(args.repeats):
        for kind, tokenizer in tokenizers.items():
            data = inputs[kind]
            if args.startup_docs:
                probe = probe_input(corpus, args.startup_docs)
                for tool in ("ours", "megatron")[:1 if args.skip_megatron else 2]:
                    for workers in args.workers[:1]:  # start-up hardly depends on the worker count
                        cores = workers if args.pin_cores else None
                        cmd = (ours_cmd(py, probe, work / "probe", tokenizer, workers, 0) if tool == "ours" else
                               megatron_cmd(py, meg, probe, work / "probe_meg", kind, tokenizer, workers))
                        wall, _, cpu, _ = run_measured(pin(cmd, cores), ours_env if tool == "ours" else meg_env,
                                                       REPO if tool == "ours" else meg_cwd[kind])
                        startup.setdefault((kind, tool, workers), []).append(wall)
                        print(f"  round {rnd + 1} {kind:13s} {tool:8s} start-up w={workers}: {wall:5.1f}s "
                              f"CPU {cpu:5.1f}s", flush=True)
            for workers in args.workers:
                cores = workers if args.pin_cores else None
                ours_prefixes = []
                for threads in args.threads_per_worker:
                    if threads == 0 and 1 in args.threads_per_worker and \
                            (cores or len(os.sched_getaffinity(0))) // workers <= 1:
                        continue  # "auto" would be 1 thread per worker here: same as the t=1 row
                    prefix = work / f"ours_{kind}_w{workers}_t{threads}"
                    cmd = ours_cmd(py, data, prefix, tokenizer, workers, threads)
                    load = load_avg()
                    wall, rss, cpu, _ = run_measured(pin(cmd, cores), ours_env, REPO)
                    tokens = json.loads(Path(f"{prefix}.manifest.json").read_text())["tokens"]
                    runs.append({"round": rnd, "kind": kind, "tool": f"ours t={threads or 'auto'}",
                                 "workers": workers, "wall": wall, "rss": rss, "cpu": cpu, "tokens": tokens,
                                 "input": str(data), "load": load})
                    ours_prefixes.append(prefix)
                    print(f"  round {rnd + 1} {kind:13s} ours t={threads or 'auto'} w={workers}: {wall:6.1f}s "
                          f"CPU {cpu:6.1f}s  RSS {rss / 2**20:5.0f}MB  (load {load})", flush=True)
                    if data in parquet:
                        pq_prefix = work / f"ours_parquet_{kind}_w{workers}_t{threads}"
                        cmd = ours_cmd(py, parquet[data], pq_prefix, tokenizer, workers, threads)
                        load = load_avg()
                        wall, rss, cpu, _ = run_measured(pin(cmd, cores), ours_env, REPO)
                        if not all(filecmp.cmp(f"{pq_prefix}{ext}", f"{prefix}{ext}", shallow=False)
                                   for ext in (".bin", ".idx")):
                            raise SystemExit(f"{kind} workers={workers}: the Parquet run's .bin/.idx differ from "
                                             f"the JSONL run's ({pq_prefix} vs {prefix})")
                        runs.append({"round": rnd, "kind": kind, "tool": f"ours parquet t={threads or 'auto'}",
                                     "workers": workers, "wall": wall, "rss": rss, "cpu": cpu, "tokens": tokens,
                                     "input": str(data), "load": load})
                        print(f"  round {rnd + 1} {kind:13s} ours parquet t={threads or 'auto'} w={workers}: "
                              f"{wall:6.1f}s CPU {cpu:6.1f}s  RSS {rss / 2**20:5.0f}MB  (load {load}); .bin/.idx "
                              "equal to the JSONL run's", flush=True)
                if args.skip_megatron:
                    continue
                meg_prefix = work / f"megatron_{kind}_w{workers}"
                mcmd = megatron_cmd(py, meg, data, meg_prefix, kind, tokenizer, workers)
                load = load_avg()
                wall, rss, cpu, _ = run_measured(pin(mcmd, cores), meg_env, meg_cwd[kind])
                same = all(filecmp.cmp(f"{p}{ext}", f"{meg_prefix}_text_document{ext}", shallow=False)
                           for p in ours_prefixes for ext in (".bin", ".idx"))
                if not same:
                    raise SystemExit(f"{kind} workers={workers}: our .bin/.idx differ from Megatron-LM's "
                                     f"({ours_prefixes} vs {meg_prefix}_text_document)")
                runs.append({"round": rnd, "kind": kind, "tool": "megatron", "workers": workers, "wall": wall,
                             "rss": rss, "cpu": cpu, "tokens": tokens, "input": str(data), "load": load,
                             "identical": same})
                print(f"  round {rnd + 1} {kind:13s} megatron  w={workers}: {wall:6.1f}s CPU {cpu:6.1f}s  "
                      f"RSS {rss / 2**20:5.0f}MB  (load {load}); .bin/.idx byte-identical: {same}", flush=True)
                if args.json_out:  # so far, in case the run is cut short
                    Path(args.json_out).write_text(json.dumps(
                        {"runs": runs, "table": summarize(runs, startup, stats, args, show=False),
                         "pinned": args.pin_cores}, indent=1))

    table = summarize(runs, startup, stats, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs, "table": table, "pinned": args.pin_cores}, indent=1))
    if not args.skip_megatron:
        print("every run's .bin/.idx was byte-identical to Megatron-LM's on the same input")
    return 0


def summarize(runs: list[dict], startup: dict, stats: dict, args, show: bool = True) -> list[dict]:
    """Medians per (kind, tool, workers), ratios to Megatron-LM; printed as a table when ``show``."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["kind"], r["tool"], r["workers"]), []).append(r)
    def start(kind, tool, workers):
        key = (kind, "megatron" if tool == "megatron" else "ours", args.workers[0])
        return median(startup[key]) if key in startup else 0.0

    meg_wall = {(k, w): median([r["wall"] for r in rs]) for (k, t, w), rs in groups.items() if t == "megatron"}
    out = print if show else (lambda *a, **k: None)
    out(f"\nmedians of {args.repeats} interleaved round(s); cores pinned = workers: {args.pin_cores}; "
        f"load now {load_avg()}")
    out(f"{'tokenizer':<13} {'tool':<20} {'workers':>7} {'MB':>6} {'wall s':>7} {'docs/s':>8} {'MB/s':>6} "
          f"{'tokens/s':>10} {'CPU s':>7} {'peak RSS':>9} {'start s':>7} {'vs Megatron':>11} {'steady':>7}")
    table = []
    for (kind, tool, workers), rs in groups.items():
        docs, size = stats[Path(rs[0]["input"])]
        wall = median([r["wall"] for r in rs])
        ratio = meg_wall.get((kind, workers), 0) / wall
        up = start(kind, tool, workers)
        meg_run = meg_wall.get((kind, workers), 0) - start(kind, "megatron", workers)
        steady = float("nan")  # when a run is mostly start-up, its steady speed is not measurable
        if startup and wall - up > 0.2 * wall and meg_run > 0.2 * meg_wall.get((kind, workers), 0):
            steady = meg_run / (wall - up)
        row = {"kind": kind, "tool": tool, "workers": workers, "mb": size / 1e6, "wall": wall,
               "docs_s": docs / wall, "mb_s": size / 1e6 / wall, "tokens_s": rs[0]["tokens"] / wall,
               "cpu": median([r["cpu"] for r in rs]), "rss_mb": max(r["rss"] for r in rs) / 2**20,
               "startup_s": up, "vs_megatron": ratio, "vs_megatron_steady": steady, "rounds": len(rs)}
        table.append(row)
        out(f"{kind:<13} {tool:<20} {workers:>7} {row['mb']:>6.1f} {wall:>7.1f} {row['docs_s']:>8,.0f} "
              f"{row['mb_s']:>6.2f} {row['tokens_s']:>10,.0f} {row['cpu']:>7.1f} {row['rss_mb']:>7,.0f}MB "
              f"{up:>7.1f} {ratio:>10.2f}x {steady:>6.2f}x")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
