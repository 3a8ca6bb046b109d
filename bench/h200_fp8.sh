#!/usr/bin/env bash
# One device call on one H200: BF16 vs FP8 (native recipes; TE recipes when it imports) vs the anchors.
# Usage, from the repo root (carry .device with hf_llama_baseline.py; for TE also .te, see ../shared/te/README.md):
#   bash bench/h200_fp8.sh [fp8_h200.py args, e.g. --only bf16 "fp8 native tensorwise"]
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "anchors" (fp8_h200.py --mcore: also mcore)
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 bench/fp8_h200.py "$@"
