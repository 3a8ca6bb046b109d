#!/usr/bin/env bash
# One device call on one H200: what checkpoint checksums cost on the trained Llama-3.2-1B state (with the save,
# load and async figures of bench/checkpoint.py), then the GPU tests.
# Usage, from the repo root, carrying .device (whl/: xxhash, pytest and its needs, for Python 3.12):
#   bash bench/h200_checkpoint.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
timeout "${BENCH_TIMEOUT:-420}" python3 bench/checkpoint.py --threads 4 --checksums-real --repeats 3 --steps 6 \
  --save-every 3
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15
