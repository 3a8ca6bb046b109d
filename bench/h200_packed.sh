#!/usr/bin/env bash
# One device call on one H200 (issue 18, packed documents), about 8 minutes:
#   1. real text (the device has no internet: documents cut from its Python installation's .py/.md/.rst/.txt
#      files, bench/prep_text.py's corpus) -> SentencePiece tokenizer -> mmtrain-prep text --append-eod
#   2. bench/packed_h200.py: compiled bf16 Llama-3.2-1B, unmasked vs packed at 4x4096, 1x16384, 1x32768
#   3. bench/attention_packed.py: one attention call, causal SDPA vs dense mask vs flex block mask (vs varlen)
#   4. 200-step loss curves, packed flex vs the dense-mask reference, same data and seed -> CSV (+ PNG)
#   5. the FP8 rows (native delayed, FP8 head) at 4x4096, unmasked vs packed; then tests/gpu for packed attention
# Stages after the first are skipped once BUDGET seconds (default 450) have passed and every stage's timeout is cut
# to end by LIMIT seconds (default 570), so the call ends inside one 600 s device command.
# Usage, from the repo root (no carried files needed; .device/whl/*.whl are installed when present):
#   bash bench/h200_packed.sh
# CPU check with tiny sizes (what the CI machine can run): TINY=1 bash bench/h200_packed.sh
# Results: $OUT (or /tmp/h200_packed): packed_h200.md, attention.md, packed_loss.csv (+ .png), packed.log
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels" (optional: installed when there)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUTF8=1
PY=${PY:-python3}
RES=${OUT:-/tmp/h200_packed}
WORK=${WORK:-/tmp/h200_packed_work}
BUDGET=${BUDGET:-450}
LIMIT=${LIMIT:-570}
mkdir -p "$RES" "$WORK"
if ls .device/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec > >(tee "$RES/packed.log") 2>&1
left() { [ "$SECONDS" -lt "$BUDGET" ] || { echo "### skipped (over BUDGET=$BUDGET s): $*"; return 1; }; }
cap() { local c=$((LIMIT - SECONDS)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }  # a timeout ending by LIMIT

if [ "${TINY:-0}" = 1 ]; then  # CPU: tiny model and sequences, no compile, no FP8
  CORPUS_MB=1; VOCAB=512; MODEL=configs/models/tiny.yaml; SCALE=64; STEPS=2; CURVE_STEPS=20
  EXTRA=(train.device=cpu train.precision=fp32 train.compile=false)
  CURVE=(--seq 128 --batch 2 train.device=cpu train.precision=fp32)
  ATTN=(--shapes 1x512 --heads 4 --kv-heads 2 --iters 1 --dtype fp32)
  BF16_ROWS=("bf16 4x4096" "bf16 4x4096 packed"); FP8_ROWS=()
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  CORPUS_MB=${CORPUS_MB:-12}; VOCAB=32000; MODEL=configs/models/llama3.2-1b.yaml; SCALE=1; STEPS=${STEPS:-6}
  CURVE_STEPS=200; EXTRA=()
  CURVE=(--seq 2048 --batch 4 model.num_layers=4)
  ATTN=(--shapes 4x4096 1x16384)
  BF16_ROWS=("bf16 4x4096" "bf16 4x4096 packed" "bf16 1x16384" "bf16 1x16384 packed" "bf16 1x32768"
             "bf16 1x32768 packed")
  FP8_ROWS=("fp8 4x4096" "fp8 4x4096 packed")
fi

echo "### 1. real text -> tokenizer -> mmtrain-prep text (${CORPUS_MB} MB)"
$PY - "$WORK/corpus.jsonl" "$CORPUS_MB" <<'EOF' || exit 1
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from prep_text import build_corpus
path = build_corpus(Path(sys.argv[1]), float(sys.argv[2]))
print(f"corpus {path}: {path.stat().st_size / 1e6:.1f} MB, {sum(1 for _ in open(path, 'rb'))} documents")
EOF
$PY -m dataprep train-tokenizer --input "$WORK/corpus.jsonl" --output-prefix "$WORK/sp" --vocab-size $VOCAB \
  --sample-docs 20000 2>&1 | tail -2 || exit 1
$PY -m dataprep text --input "$WORK/corpus.jsonl" --output-prefix "$WORK/text" --tokenizer "$WORK/sp.model" \
  --append-eod --workers 8 2>&1 | tail -3 || exit 1

echo "### 2. unmasked vs packed, compiled bf16, Llama-3.2-1B shapes, real tokens"
left "bf16 rows" && timeout "$(cap 330)" $PY bench/packed_h200.py --data "$WORK/text" --model "$MODEL" \
  --steps "$STEPS" --warmup 2 --timeout 150 --seq-scale $SCALE --only "${BF16_ROWS[@]}" -- "${EXTRA[@]}" 2>&1 \
  | grep -v '^###' | tail -n $((${#BF16_ROWS[@]} + 2))
[ -f "$RES/packed_h200.md" ] && cp "$RES/packed_h200.md" "$WORK/bf16.md"

echo "### 3. one attention call (1B heads: 32 q, 8 kv, dim 64; documents of 100-1,200 tokens), fwd+bwd"
left "attention microbench" && timeout "$(cap 90)" $PY bench/attention_packed.py "${ATTN[@]}" 2>&1 | grep -E '^\||^\(' \
  | tee "$RES/attention.md"

echo "### 4. loss curves: packed flex vs dense-mask reference, $CURVE_STEPS steps, same data and seed"
for kernel in flex dense; do
  [ "${TINY:-0}" = 1 ] && [ $kernel = flex ] && continue  # CPU: flex has no backward; the dense run checks the path
  left "loss curve $kernel" && timeout "$(cap 120)" $PY bench/train_gpt.py --model "$MODEL" --data "$WORK/text" --packed \
    --steps "$CURVE_STEPS" --warmup 0 --label "curve-$kernel" --losses-csv "$WORK/curve_$kernel.csv" "${CURVE[@]}" \
    train.document_attention=$kernel optim.lr=3e-4 optim.warmup_steps=20 data.seed=1 2>&1 | grep -E '^\{|Error' \
    | tail -2
done
[ "${TINY:-0}" = 1 ] && [ -f "$WORK/curve_dense.csv" ] && cp "$WORK/curve_dense.csv" "$WORK/curve_flex.csv"
[ -f "$WORK/curve_flex.csv" ] && [ -f "$WORK/curve_dense.csv" ] && $PY bench/packed_loss_curves.py \
  --flex "$WORK/curve_flex.csv" --dense "$WORK/curve_dense.csv" --out "$RES/packed_loss.csv"

echo "### 5. FP8 (native delayed, FP8 head), 4x4096, unmasked vs packed; GPU tests"
if [ ${#FP8_ROWS[@]} -gt 0 ] && left "fp8 rows"; then
  timeout "$(cap 240)" $PY bench/packed_h200.py --data "$WORK/text" --model "$MODEL" --steps "$STEPS" \
    --warmup 2 --timeout 120 --only "${FP8_ROWS[@]}" 2>&1 | grep -v '^###' | tail -4
  [ -f "$WORK/bf16.md" ] && { cat "$WORK/bf16.md"; tail -n +3 "$RES/packed_h200.md"; } > "$WORK/all.md" \
    && cp "$WORK/all.md" "$RES/packed_h200.md"
fi
[ "${TINY:-0}" = 1 ] || { left "gpu tests" && timeout "$(cap 90)" $PY -m pytest -q -p no:cacheprovider \
  tests/gpu/test_packed_attention_gpu.py 2>&1 | tail -3; }
echo "### done in $SECONDS s; results in $RES"
[ -f "$RES/packed_h200.md" ] && cat "$RES/packed_h200.md"
