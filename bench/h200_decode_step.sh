#!/usr/bin/env bash
# One device call on one H200 (about 5 minutes), for issue 19's batch-1 goal: the GPU generation tests (compiled ==
# eager, Llama and DeepSeek-V3), the decode step's pieces timed alone (bench/decode_kernels.py: M=1 matmuls,
# one-query attention variants), the batch-1 step's profile, and batch-1 / batch-32 generation of the 1B shapes.
# Usage, from the repo root, carrying .device (whl/: the pytest wheel):   bash bench/h200_decode_step.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"; export PYTHONPATH=/tmp/site:$PWD
echo "### GPU tests of generation"
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 \
  | grep -E "passed|failed|FAILED|Error|part at" | tail -8
echo "### the decode step's pieces (bench/decode_kernels.py)"
timeout 150 python3 bench/decode_kernels.py 2>&1 | grep -E '^\||Error|error' | head -50
echo "### where the batch-1 decode step's time goes (bench/generate_profile.py)"
timeout 80 python3 bench/generate_profile.py --batch 1 --steps 32 2>&1 | grep -E '^batch|^\|' | head -12
echo "### mmtrain generate, 1B shapes"
timeout 150 python3 bench/generate.py --batch 1 32 2>&1 | grep -E '^\||Error' | tail -4
