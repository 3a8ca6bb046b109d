#!/usr/bin/env bash
# One device call on one H200 (about 7 minutes), issue #19: the GPU generation tests; the decode step's changed
# pieces alone (bench/decode_kernels.py --quick: the split-K down projection, the two-pass argmax); the batch-1
# step's profile; mmtrain's KV-cache generation (compiled decode step with CUDA graphs) at batch 1 and 32; the
# server under 32 concurrent streams; then Hugging Face `generate` with a static cache at the same shapes
# (../shared/bench/hf_generate_baseline.py, copied to .device/ by bench/fetch_serve_wheels.sh with the server's
# wheels). Llama-3.2-1B shapes, random weights, bf16, 128-token prompts, 256 new tokens.
# Usage, from the repo root, carrying .device (whl/ and hf_generate_baseline.py):  bash bench/h200_generate.sh
# Goals (issue #19): batch 1 >= 845 new tokens/s, batch 32 >= 13.2k, server >= 1.2x HF static batch 32.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "### GPU tests of generation"
timeout 110 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 \
  | grep -E "passed|failed|FAILED|Error|part at" | tail -8
echo "### the decode step's changed pieces (bench/decode_kernels.py --quick)"
timeout 60 python3 bench/decode_kernels.py --quick 2>&1 | grep -E '^\||Error|error' | head -20
echo "### where the batch-1 decode step's time goes (bench/generate_profile.py)"
timeout 60 python3 bench/generate_profile.py --batch 1 --steps 32 2>&1 | grep -E '^batch|^\|' | head -12
echo "### mmtrain generate (compiled, CUDA graphs)"
timeout 130 python3 bench/generate.py --batch 1 32 2>&1 | grep -E '^\{|^\||Error' | tail -8
echo "### mmtrain serve, 32 concurrent streams"
timeout 110 python3 bench/serve_load.py --clients 32 2>&1 | grep -E '^\{|^\||Error|error' | tail -6
echo "### HF generate, static cache"
[ -f .device/hf_generate_baseline.py ] && timeout 110 python3 .device/hf_generate_baseline.py --cache static 2>&1 \
  | grep -E '^\{' | tail -3
