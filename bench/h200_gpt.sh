#!/usr/bin/env bash
# One device call on one H200: mmtrain's GPT engine variants, then the Hugging Face anchor (same shapes/optimizer).
# Usage (from the repo root, with .device/hf_llama_baseline.py carried): bash bench/h200_gpt.sh
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { echo "### $*"; timeout 300 "$@" 2>&1 | grep -E '^\{|Error|error' | tail -3; }
run python3 bench/train_gpt.py --label mmtrain-eager
run python3 bench/train_gpt.py --label mmtrain-compiled train.compile=true
run python3 bench/train_gpt.py --label mmtrain-compiled-selective train.compile=true train.activation_checkpointing=selective
[ -f .device/hf_llama_baseline.py ] && run python3 .device/hf_llama_baseline.py
