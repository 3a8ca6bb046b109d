#!/usr/bin/env bash
# One device call on one H200 (issue #18): the ~2B VLM trained on real prepped media shards with media.pack=false
# and media.pack=true (compiled bf16, same seq_length and micro-batch): real (non-pad) tokens/s, fill, samples/s.
# Setup (here): bash bench/fetch_energon_wheels.sh   -> .device/whl (megatron-energon, webdataset and what they import)
# Run (device, repo root, carry=[".device"]):       bash bench/h200_vlm_pack.sh      (~5-7 min: prep ~1, 2 trainings)
# Knobs: IMAGES (800), STEPS (6 timed), WARMUP (3), WORKERS (6 media loader processes), EAGER=1 (no compile).
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import megatron.energon, webdataset; print('energon', megatron.energon.__version__ if hasattr(megatron.energon, '__version__') else 'ok')" || exit 2
COMPILE=--compile; [ "${EAGER:-0}" = 1 ] && COMPILE=
timeout 560 python3 bench/vlm_pack_h200.py $COMPILE --images "${IMAGES:-800}" --steps "${STEPS:-6}" \
  --warmup "${WARMUP:-3}" --workers "${WORKERS:-6}" --timeout 250 --work /tmp/bench-vlm-pack 2>&1 | \
  grep -vE '^\s*$|UserWarning|warnings.warn' | tail -20
