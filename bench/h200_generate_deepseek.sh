#!/usr/bin/env bash
# One device call on one H200 (about 8 minutes): KV-cache generation of a DeepSeek-V3-family model at
# DeepSeek-V2-Lite shapes (27 MLA layers, 64 routed experts, 6 + 2 shared per token; random weights, bf16; the
# latent cache, decode steps in the latent space), compiled (CUDA graphs) and eager, batch 1 and 32, 128-token
# prompts, 256 new tokens; first the GPU generation tests (compiled == eager for Llama and DeepSeek-V3).
# Usage, from the repo root, carrying .device (whl/: the pytest and serve wheels, as bench/h200_generate.sh):
#   bash bench/h200_generate_deepseek.sh      (SKIP_TESTS=1 skips the tests); second, a profile of the
#   Llama-3.2-1B batch-1 decode step (issue 19: GPU busy time against wall time per step, the top kernels)
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ "${SKIP_TESTS:-0}" = 1 ] || { echo "### GPU tests of generation"
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 \
    | grep -E "passed|failed|Error|part at" | tail -6; }
echo "### where the Llama-3.2-1B batch-1 decode step's time goes (bench/generate_profile.py)"
timeout 100 python3 bench/generate_profile.py --batch 1 --steps 32 2>&1 | grep -E '^batch|^\|' | head -20
echo "### mmtrain generate, deepseek_v3 at DeepSeek-V2-Lite shapes (compiled with CUDA graphs, then eager)"
timeout 340 python3 bench/generate.py --family deepseek_v3 --batch 1 32 --eager-too 2>&1 \
  | grep -E '^\{|^\||Error' | tail -10
