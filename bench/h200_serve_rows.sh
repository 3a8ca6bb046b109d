#!/usr/bin/env bash
# Issue #32's serving, decode and VLM rows on one H200 in one device call (at most ~9 minutes), each beside its
# anchor:
#   before : the server of the tree before the frontend process (PREV, a `git archive` inside the carried .device),
#            bench/serve_load.py --clients 32 as that tree has it
#   engine : this tree's engine alone, bench/generate.py --batch 1 32 (the server row's ceiling; the decode row)
#   serve  : this tree's server, bench/serve_load.py --clients 32 (python -m mmtrain.serve's two processes);
#            SERVE_ARGS adds options (--trace FILE: both processes' events in the timed round; SERVE_LINES=80)
#   hf     : transformers' generate with a static cache, batch 1 and 32 (.device/hf_generate_baseline.py)
#   sprof  : bench/serve_profile.py: each server thread's CPU time per new token (where the host time goes)
#   sprof_before : the same for the PREV tree's server
#   serve_h11, sprof_h11 : serve and sprof of this tree with the wheels but httptools (uvicorn then parses with
#            h11, as before session 24): what httptools is worth on the device's host
#   dprof  : bench/generate_profile.py --batch 1: the decode step's kernels (where the GPU time goes)
#   vlm    : bench/vlm_h200.py --compile --profile --host-profile (the ~2B VLM, 8x1024, 448 px; the GPU profile
#            summary and the host's cProfile table to $OUT)
# Llama-3.2-1B shapes, random weights, bf16, 128-token prompts, 256 new tokens for the serving rows.
# Every stage runs under `timeout -k`; a stage is skipped once BUDGET seconds (default 470) have passed, and each
# timeout is cut to end by LIMIT (default 540).
# Usage (repo root):  git archive --prefix=.device/prev/ REV | tar x     (REV: the tree before, e.g. 0742386)
#   (device, carry=[".device"]):  PREV=.device/prev bash bench/h200_serve_rows.sh   [STAGES="..."]
# CPU check:  TINY=1 PREV=.device/prev STAGES="before engine serve sprof" bash bench/h200_serve_rows.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels anchors prev"
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
RES=${OUT:-/tmp/h200_serve_rows}
BUDGET=${BUDGET:-470}
LIMIT=${LIMIT:-540}
mkdir -p "$RES"
exec > >(tee "$RES/serve_rows.log") 2>&1
[ "${TINY:-0}" = 1 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"
[ "${TINY:-0}" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
here=$PWD
T=(); [ "${TINY:-0}" = 1 ] && T=(--tiny --device cpu)  # CPU check of the plumbing: tiny model, no GPU stages
left() { [ "$SECONDS" -lt "$BUDGET" ] || { echo "### skipped (over BUDGET=$BUDGET s): $*"; return 1; }; }
cap() { local c=$((LIMIT - SECONDS)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }
tree() {  # directory, seconds, command...: run in that tree with its own code first on the path
  local dir=$1 secs=$2; shift 2
  (cd "$dir" && PYTHONPATH=${SITE:-/tmp/site}:$PWD timeout -k 5 "$(cap "$secs")" "$@")
}
h11_site() {  # /tmp/site_h11: the wheels without httptools (TINY: the venv's packages as they are)
  [ "${TINY:-0}" = 1 ] || [ -d /tmp/site_h11 ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site_h11 $(ls .device/whl/*.whl | grep -v /httptools-) 2>&1 | grep -v "already exists"
}
for stage in ${STAGES:-engine serve vlm before hf dprof sprof}; do
  left "$stage" || continue
  echo "### $stage ($SECONDS s)"
  case $stage in
    before) [ -n "${PREV:-}" ] || { echo "no PREV tree"; continue; }
            tree "$PREV" 150 python3 bench/serve_load.py --clients 32 "${T[@]}" 2>&1 | grep -E '^\||^\{|Error|error' | tail -4 ;;
    engine) tree "$here" 150 python3 bench/generate.py --batch 1 32 "${T[@]}" 2>&1 | grep -E '^\||Error' | tail -4 ;;
    serve) tree "$here" 150 python3 bench/serve_load.py --clients 32 "${T[@]}" ${SERVE_ARGS:-} 2>&1 \
             | grep -E '^\||^\{|###|Error|error' | tail -"${SERVE_LINES:-4}" ;;
    hf) timeout -k 5 "$(cap 120)" python3 .device/hf_generate_baseline.py --batch 1 32 --cache static 2>&1 \
          | grep -E '^\{|Error' | tail -3 ;;
    sprof) tree "$here" 120 python3 bench/serve_profile.py "${T[@]}" ${SPROF_ARGS:-} 2>&1 | grep -vE "^\{|INFO:" | tail -40 ;;
    serve_h11) h11_site; SITE=/tmp/site_h11 tree "$here" 150 python3 bench/serve_load.py --clients 32 "${T[@]}" \
                 ${SERVE_ARGS:-} 2>&1 | grep -E '^\||^\{|###|Error|error' | tail -"${SERVE_LINES:-4}" ;;
    sprof_h11) h11_site; SITE=/tmp/site_h11 tree "$here" 120 python3 bench/serve_profile.py "${T[@]}" ${SPROF_ARGS:-} \
                 2>&1 | grep -vE "^\{|INFO:" | tail -40 ;;
    sprof_before) [ -n "${PREV:-}" ] || { echo "no PREV tree"; continue; }
                  tree "$PREV" 120 python3 bench/serve_profile.py "${T[@]}" ${SPROF_ARGS:-} 2>&1 | grep -vE "^\{|INFO:" | tail -40 ;;
    dprof) tree "$here" 90 python3 bench/generate_profile.py --batch 1 "${T[@]}" 2>&1 | tail -25 ;;
    vlm) tree "$here" 180 python3 bench/vlm_h200.py --compile --label mmtrain-vlm --profile "$RES/prof_vlm.md" \
           --steps 10 --host-profile "$RES/host_vlm.md" ${VLM_ARGS:-} 2>&1 | tail -4
         [ -f "$RES/prof_vlm.md" ] && head -14 "$RES/prof_vlm.md"
         [ -f "$RES/host_vlm.md" ] && head -20 "$RES/host_vlm.md" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "### done ($SECONDS s)"
true
