#!/usr/bin/env bash
# One device call on two H200s: parallel.fsdp=true (ZeRO-3 on the buckets) against DP2 with the distributed
# optimizer, Llama-3.2-1B shapes: tokens/s per GPU and peak memory (one JSON line per run from bench/train_gpt.py);
# then the Llama-3-8B shape at 2 x 8192 per GPU in BF16, and in FP8 (delayed, FP8 head, selective recompute, bf16
# Adam, compiled blocks: the one-GPU 15,834 tokens/s / 133 GiB setting) with FSDP (FP8 weights all-gathered in FP8)
# against DP2 with the distributed optimizer and fp8.param_gather; then FSDP2 losses against one GPU's over 20 steps
# (same global batch), in BF16 and in FP8. Target (issue #23): 8B FSDP2 + FP8 >= 17k tokens/s/GPU, peak <= 100 GiB.
# The 1B rows run without compile (plus compiled DP2 and FSDP2 rows). FP8 rows are skipped with CPU=1.
# Usage (repo root): bash bench/h200x2_fsdp.sh
# CPU smoke test with tiny sizes: CPU=1 bash bench/h200x2_fsdp.sh
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
MODEL=(); SIZE=(); EXTRA=(); BIG=(--model configs/models/llama3-8b.yaml --batch 2 --seq 8192)
if [ "${CPU:-0}" = 1 ]; then
  MODEL=(--model configs/models/tiny.yaml); SIZE=(--batch 1 --seq 32 --steps 2 --warmup 1)
  EXTRA=(train.device=cpu train.precision=fp32); BIG=(--model configs/models/tiny.yaml --batch 1 --seq 32 --steps 2 --warmup 1)
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
run() { echo "### $*"; timeout 400 "$@" 2>&1 | grep -E '^\{|Error|error' | tail -4; }
one() { CUDA_VISIBLE_DEVICES=0 run python3 "$@"; }
two() { run torchrun --nproc_per_node 2 --master_port 29613 "$@"; }
B=(bench/train_gpt.py "${MODEL[@]}" "${SIZE[@]}")
two "${B[@]}" --label dp2-distopt "${EXTRA[@]}"
two "${B[@]}" --label fsdp2 parallel.fsdp=true "${EXTRA[@]}"
two "${B[@]}" --label dp2-distopt-bf16adamw optim.master_weights=false "${EXTRA[@]}"
two "${B[@]}" --label fsdp2-bf16adamw parallel.fsdp=true optim.master_weights=false "${EXTRA[@]}"
two "${B[@]}" --label dp2-distopt-recompute train.activation_checkpointing=full "${EXTRA[@]}"
two "${B[@]}" --label fsdp2-recompute parallel.fsdp=true train.activation_checkpointing=full "${EXTRA[@]}"
[ "${CPU:-0}" = 1 ] || two "${B[@]}" --label dp2-distopt-compiled train.compile=true
[ "${CPU:-0}" = 1 ] || two "${B[@]}" --label fsdp2-compiled parallel.fsdp=true train.compile=true
# the 8B shape: with FSDP the blocks' weights and gradients are halved per GPU
two bench/train_gpt.py "${BIG[@]}" --label 8b-fsdp2-selective parallel.fsdp=true train.activation_checkpointing=selective optim.master_weights=false "${EXTRA[@]}"
two bench/train_gpt.py "${BIG[@]}" --label 8b-dp2-distopt-selective train.activation_checkpointing=selective optim.master_weights=false "${EXTRA[@]}"
# the 8B FP8 proof: FSDP2 + FP8 (the blocks' FP8 weights gathered in FP8 per use), against DP2 + fp8.param_gather
FP8=(train.precision=fp8 fp8.backend=native fp8.recipe=delayed fp8.output_layer=true train.activation_checkpointing=selective optim.master_weights=false train.compile=true)
[ "${CPU:-0}" = 1 ] || two bench/train_gpt.py "${BIG[@]}" --label 8b-fsdp2-fp8 parallel.fsdp=true "${FP8[@]}"
[ "${CPU:-0}" = 1 ] || two bench/train_gpt.py "${BIG[@]}" --label 8b-dp2-distopt-fp8-param-gather fp8.param_gather=true "${FP8[@]}"
# loss parity: global batch 8, 20 steps, same mock samples
P=(--steps 20 --warmup 0 --print-losses train.global_batch_size=8)
[ "${CPU:-0}" = 1 ] && P=(--steps 3 --warmup 0 --batch 1 --seq 32 --print-losses train.global_batch_size=2)
one bench/train_gpt.py "${MODEL[@]}" --label parity-1gpu "${P[@]}" "${EXTRA[@]}"
two bench/train_gpt.py "${MODEL[@]}" --label parity-fsdp2 "${P[@]}" parallel.fsdp=true "${EXTRA[@]}"
# FP8 loss parity (1B shape): FSDP2 + FP8 against one GPU in FP8
F8=(train.precision=fp8 fp8.backend=native fp8.recipe=delayed)
[ "${CPU:-0}" = 1 ] || one bench/train_gpt.py "${MODEL[@]}" --label parity-1gpu-fp8 "${P[@]}" "${F8[@]}"
[ "${CPU:-0}" = 1 ] || two bench/train_gpt.py "${MODEL[@]}" --label parity-fsdp2-fp8 "${P[@]}" parallel.fsdp=true "${F8[@]}"
