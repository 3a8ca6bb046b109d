#!/usr/bin/env bash
# One device call on one H200: mmtrain's GPT engine variants, then the Hugging Face anchor (same shapes).
# Usage (from the repo root, with .device/hf_llama_baseline.py carried): bash bench/h200_gpt.sh [profile]
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "anchors"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { echo "### $*"; timeout 300 "$@" 2>&1 | grep -E '^\{|Error|error' | tail -3; }
if [ "${1:-}" = profile ]; then
  timeout 300 python3 bench/profile_gpt.py train.compile=true 2>&1 | tail -45
fi
run python3 bench/train_gpt.py --label mmtrain-compiled train.compile=true
# packed documents (issue 18): mock tokens in ~650-token documents, FlexAttention block masks
run python3 bench/train_gpt.py --label mmtrain-compiled-packed --mock-doc-mean 650 --packed train.compile=true
run python3 bench/train_gpt.py --label mmtrain-compiled-cudnn train.compile=true train.attention_backend=cudnn
run python3 bench/train_gpt.py --label mmtrain-compiled-flash train.compile=true train.attention_backend=flash
[ -f .device/hf_llama_baseline.py ] && run python3 .device/hf_llama_baseline.py
