#!/usr/bin/env bash
# Issue #32 on one H200: each training row through the product's loop (bench/train_gpt.py -> train_gpt, compiled,
# on the prepped tokens in .device/data/text), with the profile summary of its last two timed steps
# (bench/profile_summary.py), beside its anchor in the same call. Stages (STAGES, in order):
#   bf16    : Llama-3.2-1B shapes, 4x4096                                 (+ HF transformers anchor: hf)
#   fp8     : same, FP8 native delayed, fast backward, FP8 head
#   packed  : same as bf16 with packed documents (reset positions/attention, EOD loss mask)
#   packed_flash : same as packed with train.document_attention=flex_flash (FlexAttention's FLASH backend:
#             flash-attn-4 in /tmp/fa4site from bench/flash_device.sh's two calls)
#   moe     : configs/models/deepseek-v2-lite-4l.yaml, 2x4096
#   moe_gbs : same, 8 micro-batches of 2x4096 per step (train.global_batch_size=16: the optimizer amortized)
#   vlm     : bench/vlm_h200.py --compile (the ~2B VLM, 8x1024, 448 px)
#   hf      : ../shared/bench/hf_llama_baseline.py (copied to .device/anchors), 4x4096
#   decode  : bench/generate.py --batch 1 32, then bench/generate_profile.py --batch 1
#   prev_bf16, prev_fp8, prev_packed, prev_moe_gbs : the same row run by the tree before (PREV, a `git archive`
#             inside the carried .device: bash bench/make_device_dir.sh --parts prev), without a profile
# Usage (repo root; carry .device):  STAGES="bf16 fp8 packed moe" bash bench/h200_speed.sh
# A stage is skipped once BUDGET seconds (default 540) have passed; each run's timeout is cut to end by LIMIT (570).
# Profiles go to $OUT (the device tool's returned folder) or /tmp.
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data anchors"
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DATA=${DATA:-.device/data/text}
PROF=${OUT:-/tmp}
CAP=${CAP:-200}
BUDGET=${BUDGET:-540}
LIMIT=${LIMIT:-570}
here=$PWD
cap() { local c=$((LIMIT - SECONDS)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }
FP8="train.precision=fp8 fp8.backend=native fp8.recipe=delayed fp8.fast_accum_backward=true fp8.output_layer=true"
rows=()
train() {  # label, extra args...  (a label prev_* runs the PREV tree's bench, without a profile)
  local label=$1; shift
  local dir=$here prof=(--profile "$PROF/prof_$label.md")
  case $label in prev_*) [ -n "${PREV:-}" ] || { echo "no PREV tree"; return; }; dir=$here/$PREV; prof=() ;; esac
  echo "### $label ($SECONDS s)"
  local out
  out=$(cd "$dir" && PYTHONPATH=$PWD${EXTRA_PATH:+:$EXTRA_PATH} timeout -k 5 "$(cap "$CAP")" python3 bench/train_gpt.py --data "$here/$DATA" \
        --label "$label" "${prof[@]}" "$@" 2>&1 | tee "/tmp/$label.log" | grep -E '^\{' | tail -1)
  [ -n "$out" ] || tail -6 "/tmp/$label.log"
  echo "$out"
  rows+=("$label|$out")
}
for stage in ${STAGES:-bf16 fp8 packed moe}; do
  [ "$SECONDS" -lt "$BUDGET" ] || { echo "### skipped (over BUDGET=$BUDGET s): $stage"; continue; }
  case $stage in
    bf16|prev_bf16) train $stage --batch 4 --seq 4096 train.compile=true ${EXTRA:-} ;;
    fp8|prev_fp8) train $stage --batch 4 --seq 4096 train.compile=true $FP8 ${EXTRA:-} ;;
    packed|prev_packed) train $stage --batch 4 --seq 4096 --packed train.compile=true ${EXTRA:-} ;;
    packed_flash) EXTRA_PATH=$(bash bench/flash_device.sh path) train $stage --batch 4 --seq 4096 --packed \
                    train.compile=true train.document_attention=flex_flash ${EXTRA:-} ;;
    moe) train moe --model configs/models/deepseek-v2-lite-4l.yaml --batch 2 --seq 4096 train.compile=true \
           ${EXTRA_MOE:-} ;;
    moe_gbs|prev_moe_gbs) train $stage --model configs/models/deepseek-v2-lite-4l.yaml --batch 2 --seq 4096 --steps 6 \
               train.compile=true train.global_batch_size=16 ${EXTRA_MOE:-} ;;
    vlm) echo "### vlm"
         PYTHONPATH=$PWD timeout -k 5 "$(cap "$CAP")" python3 bench/vlm_h200.py --compile --label mmtrain-vlm --profile "$PROF/prof_vlm.md" \
           ${VLM_ARGS:-} 2>&1 | tail -4 ;;
    hf) echo "### hf"
        out=$(timeout -k 5 "$(cap 150)" python3 .device/anchors/hf_llama_baseline.py 2>&1 | tee /tmp/hf.log | grep -E '^\{' | tail -1)
        [ -n "$out" ] || tail -4 /tmp/hf.log
        echo "$out"; rows+=("hf|$out") ;;
    decode) echo "### decode"
            PYTHONPATH=$PWD timeout -k 5 150 python3 bench/generate.py --batch 1 32 2>&1 | grep -E '^\||Error' | tail -4
            PYTHONPATH=$PWD timeout -k 5 120 python3 bench/generate_profile.py --batch 1 2>&1 | tail -25 ;;
  esac
done
echo "### table ($SECONDS s)"
echo "| row | tokens/s | step ms | MFU | peak GiB | loss |"
echo "|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  python3 - "$r" <<'EOF'
import json, sys
name, out = sys.argv[1].split("|", 1)
d = json.loads(out) if out.startswith("{") else {}
print(f"| {name} | {d.get('tokens_per_s', 'failed')} | {d.get('step_ms', '-')} | {d.get('mfu', '-')} | "
      f"{d.get('peak_mem_gib', '-')} | {d.get('loss', '-')} |")
EOF
done
for f in "$PROF"/prof_*.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
true
