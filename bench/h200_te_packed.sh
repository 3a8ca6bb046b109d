#!/usr/bin/env bash
# Issue 18's last GPU point: packed documents compose with the Transformer Engine FP8 backend. On one H200:
# the TE variants of tests/gpu/test_fp8_gpu.py (one trains packed documents), then 1B rows of bench/train_gpt.py
# with TE FP8 (delayed), unmasked and packed, on mock documents of ~650 tokens (compiled, 4 x 4096).
# Setup: ../shared/te/README.md -- here `../shared/te/prepare.sh`, then one quick device call per part
# (carry [".teN"], command `mkdir -p /tmp/te && cp .teN/p /tmp/te/pN`), back to back on the warm machine; then
# this call, carrying [".te", ".device"]:   bash bench/h200_te_packed.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
bash .te/install-on-device.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  2>&1 | grep -v "already exists"; export PYTHONPATH=/tmp/site:$PWD
echo "### TE variants of the FP8 GPU tests"
t=tests/gpu/test_fp8_gpu.py::test_fp8_training_tracks_bf16  # the TE variants, one of them packed documents
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider "$t[te-delayed]" "$t[te-tensorwise-true]" \
  "$t[te-delayed-true-true-true-true]" 2>&1 | grep -E "passed|failed|Error|SKIPPED" | tail -6
for packed in "" "--packed"; do
  echo "### 1B, TE FP8 delayed, 4 x 4096, mock documents of ~650 tokens ${packed:-(no document mask)}"
  timeout 150 python3 bench/train_gpt.py --label "te${packed}" --mock-doc-mean 650 $packed train.compile=true \
    train.precision=fp8 fp8.backend=te fp8.recipe=delayed optim.master_weights=false 2>&1 | grep -E '^\{|Error' | tail -2
done
