#!/usr/bin/env bash
# One device call on one H200 (about 6 minutes), issue #19: the GPU generation tests; mmtrain's KV-cache
# generation (compiled decode step with CUDA graphs) at batch 1 and 32; the server under 32 concurrent streams;
# Hugging Face `generate` with a static cache at the same shapes (../shared/bench/hf_generate_baseline.py, copied
# to .device/ by bench/fetch_serve_wheels.sh with the server's wheels); then the batch-1 step's profile with
# inductor's performance hints (a step that loses its CUDA graphs says why). Llama-3.2-1B shapes, random weights,
# bf16, 128-token prompts, 256 new tokens. With PREV=dir (a `git archive` of another tree inside the carried
# folders), the profile runs there too.
# Usage, from the repo root, carrying .device (whl/ and hf_generate_baseline.py):  bash bench/h200_generate.sh
# Goals (issue #19): batch 1 >= 845 new tokens/s, batch 32 >= 13.2k, server >= 1.2x HF static batch 32.
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels anchors prev"
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "### GPU tests of generation"
timeout 100 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_generate_gpu.py 2>&1 \
  | grep -E "passed|failed|FAILED|Error|part at" | tail -8
echo "### mmtrain generate (compiled, CUDA graphs)"
timeout 80 python3 bench/generate.py --batch 1 32 2>&1 | grep -E '^\||Error' | tail -4
echo "### mmtrain serve, 32 concurrent streams"
timeout 80 python3 bench/serve_load.py --clients 32 2>&1 | grep -E '^\||Error|error' | tail -3
echo "### HF generate, static cache"
[ -f .device/hf_generate_baseline.py ] && timeout 60 python3 .device/hf_generate_baseline.py --cache static 2>&1 \
  | grep -E '^\{' | tail -3
profile() {
  TORCH_LOGS=perf_hints timeout 45 python3 bench/generate_profile.py --batch 1 --steps 32 2>&1 \
    | grep -E '^batch|^\||skipping cudagraphs' | head -8
}
echo "### the batch-1 step's profile (bench/generate_profile.py, TORCH_LOGS=perf_hints)"
profile
[ -n "${PREV:-}" ] && { echo "### the same in $PREV"; cd "$PREV" && PYTHONPATH=/tmp/site:$PWD profile; }
true
