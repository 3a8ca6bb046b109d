#!/usr/bin/env bash
# One device call on two H200s: context parallelism at 32k and 64k tokens per sequence, and MoE (8 experts,
# top-2, expert FFN 4096) under EP2 with grouped GEMM vs a loop over experts; then profiles for the time in
# all-to-all / K-V all-gather / attention. Llama-3.2-1B shapes; bf16 AdamW like the anchors. CP rows with
# parallel.cp_comm=ring (K/V ring behind attention) beside the all-gather; bench/h200x2_cp_ring.sh has more.
# Anchors (../shared/bench/README.md, Megatron-Core+TE on these machines): CP2 32k 29,075, CP2 64k 19,713,
# MoE EP2 38,177 tokens/s per GPU.
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8
run() { echo "### $*"; timeout 240 "$@" 2>&1 | grep -E '^\{|Error|error' | tail -4; }
two() { run torchrun --nproc_per_node 2 --master_port 29612 "$@"; }
B="--steps 6 --warmup 2 train.compile=true optim.master_weights=false"
MOE="model.num_experts=8 model.moe_top_k=2 model.moe_ffn_hidden_size=4096 parallel.dp=2 parallel.ep=2"
two bench/train_gpt.py --label cp2-32k --batch 1 --seq 32768 $B parallel.cp=2
two bench/train_gpt.py --label cp2-64k --batch 1 --seq 65536 $B parallel.cp=2
two bench/train_gpt.py --label cp2-32k-ring --batch 1 --seq 32768 $B parallel.cp=2 parallel.cp_comm=ring
two bench/train_gpt.py --label cp2-64k-ring --batch 1 --seq 65536 $B parallel.cp=2 parallel.cp_comm=ring
two bench/train_gpt.py --label moe-ep2-grouped --batch 4 --seq 4096 $B $MOE
two bench/train_gpt.py --label moe-ep2-loop --batch 4 --seq 4096 $B $MOE model.moe_grouped_gemm=false
PROFILE_LABEL=cp2-32k timeout 240 torchrun --nproc_per_node 2 --master_port 29613 bench/profile_gpt.py --batch 1 --seq 32768 --rows 12 train.compile=true optim.master_weights=false parallel.cp=2 2>&1 | grep -E '^\{' | tail -2
PROFILE_LABEL=moe-ep2 timeout 240 torchrun --nproc_per_node 2 --master_port 29614 bench/profile_gpt.py --batch 4 --seq 4096 --rows 12 train.compile=true optim.master_weights=false $MOE 2>&1 | grep -E '^\{' | tail -2
