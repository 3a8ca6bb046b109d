#!/usr/bin/env bash
# Issue #32's decode rows and #34's batch-1 FP8 ratio on one H200, in one call (carry .device: whl/, and for the
# fp8 stage whl-after34/, whl-transformers/, data/; .device/prev = `git archive REV` of the tree to compare):
#   tests     : tests/gpu/test_decode_attention_gpu.py, test_generate_gpu.py, test_prefill_attention_gpu.py
#   gemv      : bench/gemv.py --sweep --rows 1 2 4 8 (the bf16 decode linears: cuBLAS against mmtrain.model.gemv)
#   attention : bench/decode_attention.py (a layer's decode attention: unfused against the one kernel, per split)
#   generate  : bench/generate.py --batch 1 32 in this tree and in .device/prev, ROUNDS (2) times each
#   profile   : bench/generate_profile.py --batch 1 (where the batch-1 step's time goes, the top kernels)
#   fp8       : bench/h200_fp8_decode.sh part 2 (random 1B, its FP8 folder, bf16 and FP8 batch-1 decode through the
#               product's engine)
# Session 22 ran these stages as session scripts (bench/results/h200_2026-12-04_s22.md); this file gathers them.
# Usage (device, repo root): [STAGES="tests gemv attention generate profile fp8"] bash bench/h200_decode_rows.sh
# CPU check (the generate and profile stages at tiny shapes): TINY=1 bash bench/h200_decode_rows.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STAGES=${STAGES:-tests gemv attention generate profile fp8}
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
if [ "${TINY:-0}" = 1 ]; then
  STAGES="generate profile"; TINYARGS=(--tiny --device cpu --prompt 8); GENARGS=(--new 16 --dtype fp32)
else
  TINYARGS=(); GENARGS=()
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl 2>&1 \
    | grep -v "already exists" | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD
if has tests; then
  echo "### GPU tests of decoding [${SECONDS}s]"
  timeout -k 5 200 $PY -m pytest -q -rf -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py \
    tests/gpu/test_generate_gpu.py tests/gpu/test_prefill_attention_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
fi
if has gemv; then
  echo "### the bf16 decode linears (bench/gemv.py) [${SECONDS}s]"
  timeout -k 5 240 $PY bench/gemv.py --sweep --rows 1 2 4 8 2>&1 | grep -E '^\||Error|^[0-9]+ s' | head -160
fi
if has attention; then
  echo "### a layer's decode attention (bench/decode_attention.py) [${SECONDS}s]"
  timeout -k 5 150 $PY bench/decode_attention.py --reps 100 2>&1 | grep -E '^[0-9]|^\||Error' | head -140
fi
if has generate; then
  for round in $(seq "${ROUNDS:-2}"); do
    echo "### bench/generate.py, this tree (round $round) [${SECONDS}s]"
    timeout -k 5 150 $PY bench/generate.py --batch 1 32 "${TINYARGS[@]}" "${GENARGS[@]}" 2>&1 | grep -E '^\| mmtrain|Error' | tail -2
    if [ -d .device/prev ]; then
      echo "### bench/generate.py, .device/prev (round $round) [${SECONDS}s]"
      (cd .device/prev && PYTHONPATH=/tmp/site:$PWD timeout -k 5 150 $PY bench/generate.py --batch 1 32 \
        "${TINYARGS[@]}" "${GENARGS[@]}" 2>&1 | grep -E '^\| mmtrain|Error' | tail -2)
    fi
  done
fi
if has profile; then
  echo "### where the batch-1 step's time goes (bench/generate_profile.py) [${SECONDS}s]"
  timeout -k 5 120 $PY bench/generate_profile.py --batch 1 --steps 32 --top 30 "${TINYARGS[@]}" 2>&1 \
    | grep -E '^batch|^\||Error' | head -34
fi
if has fp8; then
  echo "### bf16 against FP8 batch-1 decode (bench/h200_fp8_decode.sh part 2) [${SECONDS}s]"
  PYTHONPATH= PARTS=2 GPUTESTS=0 LIMIT=${FP8_LIMIT:-240} timeout -k 5 "$(( ${FP8_LIMIT:-240} + 20 ))" \
    bash bench/h200_fp8_decode.sh 2>&1 | grep -E "^\| (bf16|fp8) |Error|error" | tail -6
fi
echo "### done [${SECONDS}s]"
