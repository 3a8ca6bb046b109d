#!/usr/bin/env bash
# One device call on one H200 (about 6 minutes), issue #32's server row: the engine alone at batch 32
# (bench/generate.py) beside the server under 32 concurrent streams (bench/serve_load.py) in the tree before
# (PREV: the app and the engine thread in one process) and in this one (the app in a frontend process); then this
# tree's server thread by thread (bench/serve_profile.py: CPU and run-queue time per token of the engine thread
# and the event loop). Llama-3.2-1B shapes, random weights, bf16, 128-token prompts, 256 new tokens.
# Usage, from the repo root (bash bench/fetch_serve_wheels.sh first; PREV: a `git archive` of the tree before,
# e.g. `git archive --prefix=.device/prev/ main | tar x`), carrying .device:
#   PREV=.device/prev bash bench/h200_serve_frontend.sh
# Goal (issue #32): the server >= 0.8x its engine at batch 32 (>= 19,000 new tokens/s), TTFT p50 <= 120 ms.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
here=$PWD
echo "### the engine alone, batch 32 (this tree)"
PYTHONPATH=/tmp/site:$here timeout -k 5 120 python3 bench/generate.py --batch 32 2>&1 | grep -E '^\||Error' | tail -3
if [ -n "${PREV:-}" ]; then
  echo "### serve, 32 streams: $PREV (before)"
  (cd "$PREV" && PYTHONPATH=/tmp/site:$PWD timeout -k 5 120 python3 bench/serve_load.py --clients 32 2>&1 \
    | grep -E '^\{|^\||Error|error' | tail -4)
fi
echo "### serve, 32 streams: this tree (frontend process)"
PYTHONPATH=/tmp/site:$here timeout -k 5 120 python3 bench/serve_load.py --clients 32 2>&1 \
  | grep -E '^\{|^\||Error|error' | tail -4
echo "### this tree, thread by thread (bench/serve_profile.py)"
PYTHONPATH=/tmp/site:$here timeout -k 5 150 python3 bench/serve_profile.py --clients 32 2>&1 \
  | grep -E '^\{|^\||^server|Error|error' | tail -12
true
