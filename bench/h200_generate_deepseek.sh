#!/usr/bin/env bash
# One device call on one H200 (about 6 minutes): KV-cache generation of a DeepSeek-V3-family model at
# DeepSeek-V2-Lite shapes (27 MLA layers, 64 routed experts, 6 + 2 shared per token; random weights, bf16; the
# latent cache, decode steps in the latent space), compiled (CUDA graphs) and eager, batch 1 and 32, 128-token
# prompts, 256 new tokens; then the GPU generation tests (compiled == eager for Llama and DeepSeek-V3).
# Usage, from the repo root, carrying .device (whl/: the pytest and serve wheels, as bench/h200_generate.sh):
#   bash bench/h200_generate_deepseek.sh      (SKIP_TESTS=1 for the rows alone)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "### mmtrain generate, deepseek_v3 at DeepSeek-V2-Lite shapes (compiled with CUDA graphs, then eager)"
timeout 420 python3 bench/generate.py --family deepseek_v3 --batch 1 32 --eager-too 2>&1 \
  | grep -E '^\{|^\||Error' | tail -10
[ "${SKIP_TESTS:-0}" = 1 ] || { echo "### GPU tests of generation"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 | tail -3; }
