#!/usr/bin/env bash
# Issue #34's FP8 batch-1 decode on one H200, in one call (carry .device; results in $OUT):
#   1. bench/fp8_gemv.py --write-configs: every kernel config of each Llama-3.2-1B linear at M = 1 against bf16 and
#      _scaled_mm, weights rotating past L2; the fastest config of each shape is written into this checkout's
#      mmtrain/model/fp8_gemv.py (CONFIGS), so every later stage runs the chosen kernels
#   2. bench/h200_after_training.sh, STAGES="random quant table" (QUANTS=fp8:rtn, the GPU tests of the quantized
#      paths alongside): random 1B weights, their FP8 folder, bf16 and FP8 batch-1 decode through the product's
#      generation (perplexities of random weights mean nothing)
#   3. tests/gpu/test_host_syncs_gpu.py (the training loop's read-back)
#   4. bench/generate_profile.py --ckpt for the bf16 checkpoint and the FP8 folder: where a decode step's time goes
# Usage (device, repo root): bash bench/h200_fp8_decode.sh [PARTS="1 2 3 4"] [PROFILES="bf16 fp8"]
# CPU check: TINY=1 bash bench/h200_fp8_decode.sh
set -u
cd "$(dirname "$0")/.."
RES=${OUT:-/tmp/h200_fp8_decode}
WORK=${WORK:-/tmp/after34}
mkdir -p "$RES"
exec > >(tee "$RES/fp8_decode.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ "${TINY:-0}" = 1 ]; then
  echo "### TINY: stage 1 and 3 need a GPU; stages 2 and 4 on CPU"
  OUT=$RES/after WORK=$WORK TINY=1 QUANTS=fp8:rtn GPUTESTS=0 STAGES="random quant table" LIMIT=400 \
    bash bench/h200_after_training.sh > /dev/null
  tail -8 "$RES/after/after_training.log"
  for m in "$WORK/run/checkpoints" "$WORK/fp8-rtn"; do
    PYTHONPATH=$PWD timeout -k 5 300 $PY bench/generate_profile.py --device cpu --steps 4 --prompt 8 --top 3 --ckpt "$m" \
      > "$RES/profile.log" 2>&1
    grep -E "^batch" "$RES/profile.log" || tail -3 "$RES/profile.log"
  done
  exit 0
fi
part() { case " ${PARTS:-1 2 3 4} " in *" $1 "*) return 0 ;; esac; return 1; }
if part 1; then
  echo "### 1. kernel configs (bench/fp8_gemv.py --write-configs)"
  PYTHONPATH=$PWD timeout -k 5 200 $PY bench/fp8_gemv.py --write-configs
fi
if part 2; then
  echo "### 2. random 1B, FP8 folder, bf16 vs FP8 decode (bench/h200_after_training.sh)"
  OUT=$RES/after WORK=$WORK QUANTS=fp8:rtn STAGES="random quant table" LIMIT=${LIMIT:-330} \
    bash bench/h200_after_training.sh > /dev/null
  grep -E "^###|^\|" "$RES/after/after_training.log" | tail -24
fi
SITE=/tmp/transformers:/tmp/site:$PWD  # the wheels h200_after_training.sh installed
if part 3; then
  echo "### 3. GPU tests of the training loop's read-back"
  PYTHONPATH=$SITE timeout -k 5 120 $PY -m pytest -q -rf -p no:cacheprovider tests/gpu/test_host_syncs_gpu.py 2>&1 | tail -4
fi
part 4 && echo "### 4. decode-step profiles"
for name in ${PROFILES:-bf16 fp8}; do
  part 4 || break
  m=$WORK/run/checkpoints; [ "$name" = fp8 ] && m=$WORK/fp8-rtn
  echo "## $name: $m"
  PYTHONPATH=$SITE timeout -k 5 100 $PY bench/generate_profile.py --ckpt "$m" --top 14 2>&1 | grep -vE "^\s*$" | tail -17
done
echo "### elapsed $SECONDS s"
