#!/usr/bin/env bash
# One device call on one H200 (about 4-5 minutes): 1B packed chat SFT with mmtrain (full and LoRA r=16) against the
# Hugging Face forward/backward baseline (one conversation per row, padded; with peft LoRA when its wheel is
# carried): tokens/s, step time and peak memory, one table (bench/sft_lora.py).
# Usage, from the repo root, carrying .device/whl (xxhash, and for the HF rows transformers + peft + their
# pure-Python dependencies, wheels for the device's Python): bash bench/h200_sft.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
if ls .device/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${SFT_TIMEOUT:-330}" python3 bench/sft_lora.py --seq 4096 --batch 2 --steps "${STEPS:-8}" --warmup 2 \
  2>&1 | grep -E "^\{|^\||Error|error" | tail -16
