#!/usr/bin/env bash
# One device call on one H200 (under 10 minutes): the refactor before/after rows (bench/h200_refactor_check.sh, one
# round: 1B BF16 and FP8 on .device/before and on this tree), then the FP8 rows of the packed-documents table on
# real prepped tokens (bench/packed_h200.py), then the GPU tests of packed attention and host syncs if time is left.
# Usage, from the repo root, carrying .device (before/ and whl/): bash bench/h200_close_check.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels before" --before REV
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUTF8=1
LIMIT=${LIMIT:-585}
cap() { local c=$((LIMIT - SECONDS)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }
ROUNDS=1 SKIP_DEEPSEEK=1 SKIP_TESTS=1 bash bench/h200_refactor_check.sh
export PYTHONPATH=/tmp/site
WORK=/tmp/close_work; mkdir -p "$WORK"
echo "### real text -> tokenizer -> prep"
python3 - "$WORK/corpus.jsonl" 12 <<'PY' || exit 1
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from prep_text import build_corpus
build_corpus(Path(sys.argv[1]), float(sys.argv[2]))
PY
python3 -m dataprep train-tokenizer --input "$WORK/corpus.jsonl" --output-prefix "$WORK/sp" --vocab-size 32000 \
  --sample-docs 20000 2>&1 | tail -1
python3 -m dataprep text --input "$WORK/corpus.jsonl" --output-prefix "$WORK/text" --tokenizer "$WORK/sp.model" \
  --append-eod --workers 8 2>&1 | tail -1
echo "### FP8 (native delayed, FP8 head) 4x4096, unmasked vs packed, real tokens (at ${SECONDS}s)"
timeout "$(cap 330)" python3 bench/packed_h200.py --data "$WORK/text" --model configs/models/llama3.2-1b.yaml \
  --steps 6 --warmup 2 --timeout 160 --only "fp8 4x4096" "fp8 4x4096 packed" 2>&1 | grep -v '^###' | tail -4
echo "### GPU tests (at ${SECONDS}s)"
[ $((LIMIT - SECONDS)) -gt 40 ] && timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_packed_attention_gpu.py tests/gpu/test_host_syncs_gpu.py 2>&1 | tail -4
echo "### done in ${SECONDS}s"
