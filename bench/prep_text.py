"""Benchmark `mmtrain-prep text` against Megatron-LM's tools/preprocess_data.py on the same input.

    python bench/prep_text.py --megatron /path/to/Megatron-LM [--megatron-pythonpath EXTRA] \\
        [--input corpus.jsonl | --build-mb 100] [--tokenizer sp.model] [--workers 1 2]

Both tools run as subprocesses, interleaved per worker count so they see the same machine load, on the
same JSONL, the same tokenizer (SentencePiece: Megatron's GPTSentencePieceTokenizer; Hugging Face
tokenizer.json: its HuggingFaceTokenizer; eod = eos for both) and the same worker count, with --append-eod. Reported per run: wall time (start-up included), docs/s, MB/s, tokens/s,
peak RSS summed over the process tree, and whether the two .bin/.idx pairs are byte-identical.
``uptime`` load averages are printed with the figures. The Megatron-LM checkout is never copied here: pass
its path (and, if its imports need packages the venv lacks, a folder of them via --megatron-pythonpath).

Without --input, a corpus of real text is built from the .py/.md/.rst/.txt files of the running Python
installation, cut into documents with a log-normal length distribution (median ~1 KB, long tail), and
repeated to --build-mb. Without --tokenizer, a 32k BPE SentencePiece model is trained on a sample of it
with `mmtrain-prep train-tokenizer`.
"""

from __future__ import annotations

import argparse
import filecmp
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
    for root in roots:
        for dirpath, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                if name.endswith(_TEXT_SUFFIXES):
                    try:
                        texts.append(Path(dirpath, name).read_text(encoding="utf-8"))
                    except (UnicodeDecodeError, OSError):
                        continue
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


def build_hf_tokenizer(folder: Path, corpus: Path, vocab_size: int, sample_docs: int = 20000) -> Path:
    """Byte-level BPE tokenizer.json (+ tokenizer_config.json naming <|endoftext|> as eos), trained locally."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(corpus, encoding="utf-8") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in itertools.islice(f, sample_docs)), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return folder


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))


def run_measured(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes, summed over the process tree, sampled every 50 ms), output tail."""
    import psutil

    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = 0
    ps = psutil.Process(proc.pid)
    out_chunks: list[bytes] = []
    import threading

    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            procs = [ps] + ps.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.monotonic() - start
    reader.join()
    out = b"".join(out_chunks).decode("utf-8", "replace")
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return wall, peak, out[-2000:]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load %.2f %.2f %.2f" % os.getloadavg()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron", required=True, help="path of a Megatron-LM checkout (has tools/preprocess_data.py)")
    ap.add_argument("--megatron-pythonpath", default="", help="extra PYTHONPATH entries for Megatron-LM's imports")
    ap.add_argument("--input", default=None, help="JSONL to use (default: build one)")
    ap.add_argument("--build-mb", type=float, default=110.0, help="size of the built corpus in MB")
    ap.add_argument("--work-dir", default=None, help="where corpus, tokenizer and outputs go (default: a temp dir)")
    ap.add_argument("--tokenizer", default=None, help="SentencePiece .model (default: train a 32k BPE)")
    ap.add_argument("--hf-tokenizer", default=None,
                    help="Hugging Face tokenizer folder (default: train a 32k byte-level BPE); Megatron-LM needs "
                         "`transformers` importable for it (see --megatron-pythonpath)")
    ap.add_argument("--kinds", nargs="+", choices=("sentencepiece", "huggingface"), default=["sentencepiece"],
                    help="tokenizer kinds to benchmark")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads-per-worker", type=int, nargs="+", default=[1],
                    help="our tokenizer threads per worker; 1 = the same CPU budget per worker as Megatron, "
                         "0 = our default (CPUs / workers). Several values give one row each")
    ap.add_argument("--skip-megatron", action="store_true")
    args = ap.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="prep_text_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    corpus = Path(args.input) if args.input else work / "corpus.jsonl"
    if not corpus.exists():
        print(f"building {args.build_mb:.0f} MB corpus at {corpus} ...", flush=True)
        build_corpus(corpus, args.build_mb)
    size = corpus.stat().st_size
    docs = count_lines(corpus)
    ours_env = {**os.environ, "PYTHONPATH": str(REPO)}
    tokenizers = {}
    if "sentencepiece" in args.kinds:
        tokenizers["sentencepiece"] = Path(args.tokenizer) if args.tokenizer else work / "sp32k.model"
        if not tokenizers["sentencepiece"].exists():
            print(f"training tokenizer {tokenizers['sentencepiece']} ...", flush=True)
            subprocess.run([py, "-m", "dataprep", "train-tokenizer", "--input", str(corpus), "--output-prefix",
                            str(tokenizers["sentencepiece"].with_suffix("")), "--vocab-size", str(args.vocab_size),
                            "--sample-docs", "20000"], env=ours_env, check=True, cwd=REPO)
    if "huggingface" in args.kinds:
        tokenizers["huggingface"] = Path(args.hf_tokenizer) if args.hf_tokenizer else work / "hf32k"
        if not (tokenizers["huggingface"] / "tokenizer.json").exists():
            print(f"training tokenizer {tokenizers['huggingface']} ...", flush=True)
            build_hf_tokenizer(tokenizers["huggingface"], corpus, args.vocab_size)
    meg = Path(args.megatron).resolve()
    meg_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(meg), args.megatron_pythonpath) if p)}
    print(f"corpus {corpus}: {docs:,} documents, {size / 1e6:.1f} MB; cpus {len(os.sched_getaffinity(0))}",
          flush=True)

    rows = []
    megatron_type = {"sentencepiece": "GPTSentencePieceTokenizer", "huggingface": "HuggingFaceTokenizer"}
    for kind, tokenizer in tokenizers.items():
        for workers in args.workers:
            for threads in args.threads_per_worker:
                if threads == 0 and 1 in args.threads_per_worker and len(os.sched_getaffinity(0)) // workers <= 1:
                    continue  # "auto" would be 1 thread per worker here: same as the t=1 row
                ours_prefix = work / f"ours_{kind}_w{workers}_t{threads}"
                cmd = [py, "-m", "dataprep", "text", "--input", str(corpus), "--output-prefix", str(ours_prefix),
                       "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(workers), "--progress", "never"]
                if threads:
                    cmd += ["--threads-per-worker", str(threads)]
                load_before = uptime()
                wall, rss, _ = run_measured(cmd, ours_env, REPO)
                tokens = json.loads(Path(f"{ours_prefix}.manifest.json").read_text())["tokens"]
                rows.append((kind, f"ours t={threads or 'auto'}", workers, wall, rss, tokens, load_before))
            if not args.skip_megatron:
                meg_prefix = work / f"megatron_{kind}_w{workers}"
                mcmd = [py, str(meg / "tools" / "preprocess_data.py"), "--input", str(corpus), "--output-prefix",
                        str(meg_prefix), "--tokenizer-type", megatron_type[kind], "--tokenizer-model",
                        str(tokenizer), "--workers", str(workers), "--append-eod", "--log-interval", "1000000"]
                load_before = uptime()
                mwall, mrss, _ = run_measured(mcmd, meg_env, meg)
                rows.append((kind, "megatron", workers, mwall, mrss, tokens, load_before))
                same = all(filecmp.cmp(f"{ours_prefix}{ext}", f"{meg_prefix}_text_document{ext}", shallow=False)
                           for ext in (".bin", ".idx"))
                print(f"{kind} workers={workers}: .bin/.idx byte-identical to Megatron-LM: {same}", flush=True)

    print(f"\n{'tokenizer':<13} {'tool':<12} {'workers':>7} {'wall s':>7} {'docs/s':>8} {'MB/s':>6} "
          f"{'tokens/s':>10} {'peak RSS':>9} {'vs Megatron':>11}  load before the run")
    meg_wall = {(k, w): wall for k, tool, w, wall, *_ in rows if tool == "megatron"}
    for kind, tool, workers, wall, rss, tokens, load in rows:
        ratio = meg_wall.get((kind, workers), 0) / wall
        print(f"{kind:<13} {tool:<12} {workers:>7} {wall:>7.1f} {docs / wall:>8,.0f} {size / 1e6 / wall:>6.2f} "
              f"{tokens / wall:>10,.0f} {rss / 2**20:>7,.0f}MB {ratio:>10.2f}x  {load.split('load')[-1]}")
    print(f"after: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
