#!/usr/bin/env bash
# fp8.param_gather on two H200s (one device call, ~5 min): equivalence with the BF16 gather (compiled, NCCL) and the
# gather's cost (bench/fp8_param_gather.py), then DP2 step throughput of native FP8 with the option off and on
# (Llama-3.2-1B shapes, 4 x 4096 per GPU, compiled, bf16 AdamW as in bench/fp8_h200.py).
# Usage (repo root): bash bench/h200x2_fp8_param_gather.sh
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { echo "### $*"; timeout 400 "$@" 2>&1 | grep -E '^\{|Error|error|fp8:' | tail -6; }
two() { run torchrun --nproc_per_node 2 --master_port 29613 "$@"; }
two bench/fp8_param_gather.py
F="train.compile=true optim.master_weights=false train.precision=fp8 fp8.backend=native fp8.recipe=delayed"
two bench/train_gpt.py --label dp2-fp8-delayed $F
two bench/train_gpt.py --label dp2-fp8-delayed-param-gather $F fp8.param_gather=true
