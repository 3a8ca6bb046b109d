#!/usr/bin/env bash
# One device call on one H200 (about 9 minutes), after session 7's fixes: KV-cache generation at batch 1 and 32
# with the decode step's compile modes (bench/generate.py --compile-modes), the server under 32 streams from 4
# client processes (bench/serve_load.py), the GPU generation tests (tie-aware compiled == eager), then packed SFT
# full / LoRA against HF forward/backward and transformers.Trainer (bench/sft_lora.py), and last max-autotune at
# batch 1 (it compiles longest).
# Usage, from the repo root, carrying .device (whl/: the serve and pytest wheels; bench/fetch_serve_wheels.sh):
#   bash bench/h200_generate_sft_check.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "### mmtrain generate (compiled, CUDA graphs), compile modes"
timeout 110 python3 bench/generate.py --batch 1 32 --compile-modes reduce-overhead coordinate-descent 2>&1 \
  | grep -E '^\||Error' | tail -7
echo "### mmtrain serve, 32 concurrent streams from 4 client processes"
timeout 100 python3 bench/serve_load.py --clients 32 --client-processes 4 2>&1 | grep -E '^\{|^\||Error|error' | tail -4
echo "### GPU tests of generation"
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 | grep -E "passed|failed|Error|part at" | tail -8
echo "### packed SFT vs HF (bench/sft_lora.py)"
timeout 250 python3 bench/sft_lora.py --seq 4096 --batch 2 --steps 6 --warmup 2 2>&1 | grep -E "^\||Error|error" | tail -12
echo "### generate, max-autotune, batch 1"
timeout 60 python3 bench/generate.py --batch 1 --compile-modes max-autotune 2>&1 | grep -E '^\| mmtrain|Error' | tail -2
