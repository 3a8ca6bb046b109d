#!/usr/bin/env bash
# One device call on two H200s: 1-GPU variants + the HF anchor (GPU 0), then TP2+SP and DP2 per-GPU throughput,
# DP2 peak memory with and without the distributed optimizer, and 1-GPU vs 2-GPU losses over 20 steps.
# Usage (repo root, .device/hf_llama_baseline.py carried): bash bench/h200x2_gpt.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "anchors"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { echo "### $*"; timeout 300 "$@" 2>&1 | grep -E '^\{|Error|error' | tail -4; }
one() { CUDA_VISIBLE_DEVICES=0 run python3 "$@"; }
two() { run torchrun --nproc_per_node 2 --master_port 29611 "$@"; }
one bench/train_gpt.py --label 1gpu-compiled-fp32master train.compile=true
one bench/train_gpt.py --label 1gpu-compiled-bf16adamw train.compile=true optim.master_weights=false
[ -f .device/hf_llama_baseline.py ] && one .device/hf_llama_baseline.py
two bench/train_gpt.py --label tp2sp-compiled parallel.tp=2 parallel.sequence_parallel=true train.compile=true
two bench/train_gpt.py --label tp2sp-compiled-bf16adamw parallel.tp=2 parallel.sequence_parallel=true train.compile=true optim.master_weights=false
two bench/train_gpt.py --label dp2-distopt-compiled train.compile=true
two bench/train_gpt.py --label dp2-distopt-compiled-bf16adamw train.compile=true optim.master_weights=false
two bench/train_gpt.py --label dp2-no-distopt-compiled train.compile=true parallel.distributed_optimizer=false
# loss parity: global batch 8 x 4096, 20 steps, same mock samples
P="--steps 20 --warmup 0 --print-losses train.global_batch_size=8 train.compile=true"
one bench/train_gpt.py --label parity-1gpu $P
two bench/train_gpt.py --label parity-dp2 $P
two bench/train_gpt.py --label parity-tp2sp $P parallel.tp=2 parallel.sequence_parallel=true
