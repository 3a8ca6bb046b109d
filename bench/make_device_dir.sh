#!/usr/bin/env bash
# Rebuild, from scratch, the git-ignored .device/ folder the GPU scripts (bench/h200*.sh, bench/train_stability.sh,
# bench/prep_device.sh) read on the GPU machine, which starts bare (Python 3.12, torch, triton, numba, pillow,
# sentencepiece, transformers 5.17, tokenizers, tqdm) and gets the rest from what a device call carries (64 MiB).
# Run here, where pip can download, from anywhere in the checkout:
#   bash bench/make_device_dir.sh [--parts "data wheels anchors prev"] [--prev REV] [--before REV] [--force]
# Parts (the default is "data wheels anchors prev"):
#   data     .device/data/: text.{bin,idx,manifest.json} = `mmtrain-prep text --append-eod` of bench/prep_text.py's
#            corpus (build_corpus: CORPUS_MB (10) MB of documents cut from this venv's Python's own .py/.md/.rst/.txt
#            files, ~7.2k documents, ~2.75M tokens), with sp.model = `mmtrain-prep train-tokenizer --vocab-size 32000
#            --sample-docs 20000` (SentencePiece BPE 32k) trained on that corpus. Prepped inside the folder with
#            `--tokenizer sp.model`, so the manifest names the tokenizer relative to the data (found beside it
#            wherever .device lands); the corpus itself is not kept.
#   wheels   the fetch scripts, each into the same temporary folder, then its whl* folders renamed into place:
#            bench/fetch_serve_wheels.sh + fetch_energon_wheels.sh + fetch_hybrid_wheels.sh -> whl/ (server, pytest,
#            xxhash, energon and its imports, fla-core, einops), whl-transformers/ (transformers 5.24), whl-mamba/
#            (mamba-ssm built here without its CUDA extension); fetch_after_training_wheels.sh -> whl-after34/;
#            fetch_grpo_wheels.sh -> whl-grpo/ (all for CPython 3.12 x86_64, installed --no-deps on the device)
#   anchors  ../shared/bench/hf_llama_baseline.py and hf_generate_baseline.py (the folder beside this checkout)
#            -> .device/ (h200_gpt, h200x2_gpt, fp8_h200, h200_generate, h200_serve_rows) and .device/anchors/
#            (h200_speed)
#   prev     `git archive REV` -> .device/prev/ (REV: --prev, default 0742386, the tree before the server's frontend
#            process; PREV=.device/prev for h200_families, h200_generate, h200_serve_*, train_stability)
# Optional parts, only when named:
#   before   `git archive REV` -> .device/before/ (REV: --before, required; h200_refactor_check, h200_close_check)
#   mcore    ../shared/bench/mcore_{llama,parallel}_anchor.py -> .device/, its megatron_core wheel -> .device/whl/
#            (fp8_h200.py --mcore, h200x2_ep.sh; both also need TE: ../shared/te/README.md)
#   prep     bench/fetch_prep_wheels.sh: Megatron-LM exports (needs MEGATRON_MIRROR) and av, webdataset, ... into
#            .device/whl/ (bench/prep_device.sh; ~50 MB)
#   flash    bench/fetch_flash_wheels.sh -> .device/fa4-1/, .device/fa4-2/ (flash-attn-4 and the CuTe DSL in two
#            pieces, one call each: bench/flash_device.sh; train.document_attention=flex_flash)
# A part whose outputs are complete (files there, and the stamp in them naming the same inputs: fetch scripts,
# REV, corpus size, vocabulary) is skipped; --force rebuilds the named parts. A part is built in
# .device/.tmp-<part>.<pid> and renamed into place a folder at a time (a replaced folder is removed only after), so
# an interrupted run leaves either the old folder or the new one, never half of one. wheels replaces whl/ whole:
# name mcore / prep again after it. The end: a table of every .device entry (part, MiB) with the total, and what
# each device script reads from it (found by grepping the scripts and what they call), its size, and whether it
# fits one call; exit 1 with one line when the total is over 64 MiB (then carry a script's own entries:
# carry=[".device/whl", ".device/data", ...]).
# Knobs: PIP (default: the repo's .venv, bench/find_venv.sh), PY (the python beside PIP), JOBS (tokenizer
# threads and prep workers, default min(4, CPUs)), CORPUS_MB (10), VOCAB (32000).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$SECONDS
PARTS="data wheels anchors prev"; PREV_REV=0742386; BEFORE_REV=""; FORCE=0
while [ $# -gt 0 ]; do
  case $1 in
    --parts) PARTS=$2; shift 2 ;;
    --prev) PREV_REV=$2; shift 2 ;;
    --before) BEFORE_REV=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (bash bench/make_device_dir.sh --help)"; exit 2 ;;
  esac
done
for p in $PARTS; do
  case $p in
    data|wheels|anchors|prev|before|mcore|prep|flash) ;;
    *) echo "unknown part '$p' (data wheels anchors prev before mcore prep flash)"; exit 2 ;;
  esac
done
want() { [[ " $PARTS " == *" $1 "* ]]; }
. bench/find_venv.sh
export PIP
PY=${PY:-$(dirname "$PIP")/python}
JOBS=${JOBS:-$(n=$(nproc); echo $((n < 4 ? n : 4)))}
CORPUS_MB=${CORPUS_MB:-10}; VOCAB=${VOCAB:-32000}
SHARED=$REPO/../shared/bench
DEV=$REPO/.device
LIMIT_MIB=${LIMIT_MIB:-64}  # what one device call carries

git check-ignore -q .device/x || { echo ".device/ is not git-ignored: add '.device/' to .gitignore first"; exit 2; }
mkdir -p "$DEV"
rm -rf "$DEV"/.tmp-* "$DEV"/.old-*  # left by an interrupted run
trap 'rm -rf "$DEV"/.tmp-*."$$" "$DEV"/.old-*."$$"' EXIT
tmpdir() { local t="$DEV/.tmp-$1.$$"; rm -rf "$t"; mkdir -p "$t"; echo "$t"; }
put_dir() {  # put_dir SRC DEST: rename SRC to DEST, the old DEST (if any) removed after
  local old="$DEV/.old-$(basename "$2").$$"
  [ -e "$2" ] && mv "$2" "$old"
  mv "$1" "$2"
  rm -rf "$old"
}
put_file() {  # put_file SRC DEST: copy unless the same bytes are there (copy beside, then rename)
  cmp -s "$1" "$2" 2>/dev/null && return 0
  local t
  t="$(dirname "$2")/.tmp-$(basename "$2").$$"  # a dot name: no *.whl glob on the device takes it
  cp "$1" "$t" && mv "$t" "$2"
}
run_fetch() {  # run_fetch PART SCRIPT: bench/SCRIPT with DEV=$t, a fresh .device/.tmp-PART; its log's end on failure
  t=$(tmpdir "$1")
  DEV=$t bash "bench/$2" > "$t/fetch.log" 2>&1 || { tail -15 "$t/fetch.log"; echo "bench/$2 failed (log above)"; exit 1; }
}
stamp_ok() { [ "$FORCE" = 0 ] && [ -f "$1/.stamp" ] && [ "$(cat "$1/.stamp")" = "$2" ]; }
say() { printf '### %s (at %ss)\n' "$*" $((SECONDS - T0)); }

# ---- data --------------------------------------------------------------------------------------------------------
data_stamp="corpus=bench/prep_text.py:build_corpus(${CORPUS_MB} MB) tokenizer=sentencepiece-bpe vocab=$VOCAB"
data_stamp="$data_stamp sample_docs=20000 prep=--append-eod"
if want data; then
  if stamp_ok "$DEV/data" "$data_stamp" && [ -s "$DEV/data/text.bin" ] && [ -s "$DEV/data/text.idx" ] \
      && [ -s "$DEV/data/text.manifest.json" ] && [ -s "$DEV/data/sp.model" ]; then
    say "data: complete, skipped"
  else
    say "data: corpus (${CORPUS_MB} MB), SentencePiece BPE $VOCAB, mmtrain-prep text ($JOBS workers)"
    t=$(tmpdir data)
    (
      cd "$t"
      export PYTHONPATH="$REPO/bench:$REPO" PYTHONUTF8=1
      "$PY" -c "import sys; from pathlib import Path; from prep_text import build_corpus
build_corpus(Path('corpus.jsonl'), float(sys.argv[1]))" "$CORPUS_MB"
      "$PY" -m dataprep train-tokenizer --input corpus.jsonl --output-prefix sp --vocab-size "$VOCAB" \
        --sample-docs 20000 --threads "$JOBS" 2>&1 | tail -1
      "$PY" -m dataprep text --input corpus.jsonl --output-prefix text --tokenizer sp.model --append-eod \
        --workers "$JOBS" --no-progress 2>&1 | tail -1
      "$PY" -m dataprep verify text | tail -1
      rm -f corpus.jsonl
      echo "$data_stamp" > .stamp
    )
    put_dir "$t" "$DEV/data"
  fi
fi

# ---- wheels -------------------------------------------------------------------------------------------------------
WHEEL_SCRIPTS="fetch_serve_wheels.sh fetch_energon_wheels.sh fetch_hybrid_wheels.sh fetch_after_training_wheels.sh"
WHEEL_SCRIPTS="$WHEEL_SCRIPTS fetch_grpo_wheels.sh"
WHEEL_DIRS="whl whl-transformers whl-mamba whl-after34 whl-grpo"
wheels_stamp="$(cd bench && sha256sum $WHEEL_SCRIPTS find_venv.sh | sha256sum | cut -c1-16) ($WHEEL_SCRIPTS)"
if want wheels; then
  done_dirs=0
  for d in $WHEEL_DIRS; do
    stamp_ok "$DEV/$d" "$wheels_stamp" && ls "$DEV/$d"/*.whl >/dev/null 2>&1 && done_dirs=$((done_dirs + 1))
  done
  if [ "$done_dirs" = "$(echo $WHEEL_DIRS | wc -w)" ]; then
    say "wheels: complete, skipped"
  else
    t=$(tmpdir wheels)
    for s in $WHEEL_SCRIPTS; do
      say "wheels: bench/$s"
      DEV=$t bash "bench/$s" > "$t/$s.log" 2>&1 \
        || { tail -15 "$t/$s.log"; echo "bench/$s failed (log above)"; exit 1; }
    done
    for d in $WHEEL_DIRS; do
      ls "$t/$d"/*.whl >/dev/null 2>&1 || { echo "the fetch scripts left no $d/*.whl"; exit 1; }
      echo "$wheels_stamp" > "$t/$d/.stamp"
    done
    for d in $WHEEL_DIRS; do put_dir "$t/$d" "$DEV/$d"; done
    rm -rf "$t"
  fi
fi

# ---- prep (optional): bench/fetch_prep_wheels.sh --------------------------------------------------------------------
if want prep; then
  prep_stamp="$(sha256sum bench/fetch_prep_wheels.sh | cut -c1-16) TEXT_ONLY=${TEXT_ONLY:-0} PARQUET=${PARQUET:-0}"
  if stamp_ok "$DEV/megatron-lm" "$prep_stamp" && [ -f "$DEV/megatron-lm-head.tar.gz" ] \
      && (cd "$DEV/megatron-lm" && while read -r w; do [ -f "$DEV/whl/$w" ] || exit 1; done < .wheels); then
    say "prep: complete, skipped"
  else
    say "prep: bench/fetch_prep_wheels.sh"
    run_fetch prep fetch_prep_wheels.sh
    mkdir -p "$DEV/whl"
    (cd "$t/whl" && ls) > "$t/megatron-lm/.wheels"
    for w in "$t"/whl/*.whl; do put_file "$w" "$DEV/whl/$(basename "$w")"; done
    echo "$prep_stamp" > "$t/megatron-lm/.stamp"
    mv "$t/megatron-lm-head.tar.gz" "$DEV/megatron-lm-head.tar.gz"
    put_dir "$t/megatron-lm" "$DEV/megatron-lm"
    rm -rf "$t"
  fi
fi

# ---- flash (optional): bench/fetch_flash_wheels.sh ------------------------------------------------------------------
if want flash; then
  flash_stamp="$(sha256sum bench/fetch_flash_wheels.sh | cut -c1-16)"
  if stamp_ok "$DEV/fa4-2" "$flash_stamp" && [ -f "$DEV/fa4-1/libs.part0" ] && [ -f "$DEV/fa4-2/libs.sha256" ]; then
    say "flash: complete, skipped"
  else
    say "flash: bench/fetch_flash_wheels.sh"
    run_fetch flash fetch_flash_wheels.sh
    echo "$flash_stamp" > "$t/fa4-2/.stamp"
    put_dir "$t/fa4-1" "$DEV/fa4-1"
    put_dir "$t/fa4-2" "$DEV/fa4-2"
    rm -rf "$t"
  fi
fi

# ---- anchors: ../shared/bench --------------------------------------------------------------------------------------
if want anchors || want mcore; then
  [ -d "$SHARED" ] || { echo "no ../shared/bench beside this checkout ($SHARED): the anchors come from there"; exit 1; }
fi
if want anchors; then
  say "anchors: ../shared/bench -> .device/, .device/anchors/"
  mkdir -p "$DEV/anchors"
  for f in hf_llama_baseline.py hf_generate_baseline.py; do
    [ -f "$SHARED/$f" ] || { echo "no ../shared/bench/$f"; exit 1; }
    put_file "$SHARED/$f" "$DEV/$f"
    put_file "$SHARED/$f" "$DEV/anchors/$f"
  done
fi
if want mcore; then
  say "mcore: Megatron-Core anchors and wheel"
  for f in mcore_llama_anchor.py mcore_parallel_anchor.py; do put_file "$SHARED/$f" "$DEV/$f"; done
  mkdir -p "$DEV/whl"
  ls "$SHARED"/wheels/megatron_core-*.whl >/dev/null 2>&1 \
    || { echo "no ../shared/bench/wheels/megatron_core-*.whl"; exit 1; }
  for w in "$SHARED"/wheels/megatron_core-*.whl; do put_file "$w" "$DEV/whl/$(basename "$w")"; done
fi

# ---- prev / before: git archive ------------------------------------------------------------------------------------
archive() {  # archive NAME REV
  local rev
  rev=$(git rev-parse --verify -q "$2^{commit}") || { echo "--$1 $2: not a commit here"; exit 1; }
  if stamp_ok "$DEV/$1" "$rev" && [ -f "$DEV/$1/pyproject.toml" ]; then
    say "$1: git archive ${rev:0:7} complete, skipped"
    return
  fi
  say "$1: git archive ${rev:0:7}"
  local t
  t=$(tmpdir "$1")
  git archive "$rev" | tar -x -C "$t"
  echo "$rev" > "$t/.stamp"
  put_dir "$t" "$DEV/$1"
}
want prev && archive prev "$PREV_REV"
if want before; then
  [ -n "$BEFORE_REV" ] || { echo "part 'before' needs --before REV"; exit 2; }
  archive before "$BEFORE_REV"
fi

# ---- table --------------------------------------------------------------------------------------------------------
"$PY" - "$DEV" "$LIMIT_MIB" "$((SECONDS - T0))" <<'EOF'
import re, sys
from pathlib import Path

dev, limit, took = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
repo = dev.parent
part_of = {"data": "data", "prev": "prev", "before": "before", "anchors": "anchors", "hf_llama_baseline.py": "anchors",
           "hf_generate_baseline.py": "anchors", "mcore_llama_anchor.py": "mcore", "mcore_parallel_anchor.py": "mcore",
           "megatron-lm": "prep", "megatron-lm-head.tar.gz": "prep"}


def size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


entries = {p.name: size(p) for p in sorted(dev.iterdir()) if not p.name.startswith(".")}
mib = lambda b: b / 2**20
total = sum(entries.values())
print(f"\n.device ({took} s)\n| entry | part | MiB |\n|---|---|---|")
for name, b in entries.items():
    print(f"| {name} | {part_of.get(name, 'wheels' if name.startswith('whl') else '?')} | {mib(b):.1f} |")
print(f"| total | | {mib(total):.1f} |")

# what each device script reads: `.device/<entry>` (or $DEV/<entry>) in it (comments too: its header says what to
# carry) and in the bench scripts its code runs
ref = re.compile(r"(?:\.device|\$DEV|\$\{DEV\})/([A-Za-z0-9_.-]+)")
called = re.compile(r"bench/([A-Za-z0-9_]+\.(?:sh|py))")


def reads(path: Path, seen: set) -> set:
    if path in seen or not path.exists():
        return set()
    seen.add(path)
    text = path.read_text(errors="replace")
    out = {m.strip(".") for m in ref.findall(text) if m.strip(".")}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for c in called.findall(code):  # what it runs (not what its comments name, nor the fetch_* scripts)
        if not c.startswith(("fetch_", "make_device_dir")):
            out |= reads(repo / "bench" / c, seen)
    return out


scripts = sorted((repo / "bench").glob("h200*.sh")) + [repo / "bench/train_stability.sh", repo / "bench/prep_device.sh"]
print("\n| device script | reads from .device | MiB | one call |\n|---|---|---|---|")
for s in scripts:
    names = sorted(reads(s, set()))
    if not names:
        continue
    shown = [n if n in entries else f"{n} (not built)" for n in names]
    b = sum(entries.get(n, 0) for n in names)
    print(f"| {s.name} | {' '.join(shown)} | {mib(b):.1f} | {'fits' if mib(b) <= limit else 'TOO BIG'} |")
if mib(total) > limit:
    print(f"FAILED: .device is {mib(total):.1f} MiB, over the {limit:.0f} MiB a device call carries: carry only the "
          "entries the script reads (table above), e.g. carry=[\".device/whl\", \".device/data\"]")
    sys.exit(1)
print(f"\n.device fits one device call: carry=[\".device\"] ({mib(total):.1f} of {limit:.0f} MiB)")
EOF
