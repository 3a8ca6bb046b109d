#!/usr/bin/env bash
# One device call on one H200: the ~2B VLM (ViT ~412M + LM ~1.54B) training step, eager then compiled.
# Usage (from the repo root): bash bench/h200_vlm.sh            # ~3-4 min; `bash bench/h200_vlm.sh eager` ~1.5 min
# Two GPUs (DP2, distributed optimizer): bash bench/h200_vlm.sh dp2
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { echo "### $*"; timeout 280 "$@" 2>&1 | grep -E '^\||^\{|Error|error' | tail -16; }
case "${1:-all}" in
  dp2) run torchrun --nproc_per_node 2 bench/vlm_h200.py --label mmtrain-vlm-dp2 ;;
  eager) run python3 bench/vlm_h200.py --label mmtrain-vlm-eager ;;
  *) run python3 bench/vlm_h200.py --label mmtrain-vlm-eager
     run python3 bench/vlm_h200.py --compile --label mmtrain-vlm-compiled ;;
esac
