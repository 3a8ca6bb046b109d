#!/usr/bin/env bash
# One device call on one H200 (about 7 minutes), issue #29's speed check: the hardened server and decode engine
# must stay within 3% of the tree before. bench/generate.py (batch 1 and 32) and bench/serve_load.py (32
# concurrent streams) run in the earlier tree (PREV, a `git archive` inside the carried .device), then in this
# one, on the same warm machine; then this tree's GPU generation tests.
# Llama-3.2-1B shapes, random weights, bf16, 128-token prompts, 256 new tokens.
# Usage, from the repo root:
#   bash bench/fetch_serve_wheels.sh && git archive --prefix=.device/prev/ REV | tar x
#   (device) carry=[".device"]: PREV=.device/prev bash bench/h200_serve_regress.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels prev"
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
here=$PWD
rows() {  # $1: the tree
  cd "$1" || return
  echo "### $1: generate"
  PYTHONPATH=/tmp/site:$PWD timeout -k 5 120 python3 bench/generate.py --batch 1 32 2>&1 | grep -E '^\||Error' | tail -4
  echo "### $1: serve, 32 streams"
  PYTHONPATH=/tmp/site:$PWD timeout -k 5 120 python3 bench/serve_load.py --clients 32 2>&1 \
    | grep -E '^\||Error|error' | tail -3
  cd "$here" || return
}
[ -n "${PREV:-}" ] && rows "$PREV"
rows "$here"
echo "### GPU tests of generation (this tree)"
PYTHONPATH=/tmp/site:$PWD timeout -k 5 150 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_generate_gpu.py \
  2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
true
