#!/usr/bin/env bash
# Put into .device/whl-after34/ what bench/h200_after_training.sh needs beyond the GPU host's image (torch, transformers
# 5.17, pandas, pyarrow...) and .device/whl (pydantic, xxhash, ...): compressed-tensors and its loguru and psutil
# (mmtrain.quantize, the quantized loading), trl and accelerate (TRL's GRPOTrainer), datasets with dill and
# multiprocess (TRL imports datasets; the bench stands in for it when the host's pyarrow is too old). ~2.6 MB.
# Run here, where pip can download; then carry=[".device"].
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-/work/main/.venv/bin/pip}
mkdir -p .device/whl-after34
for spec in compressed-tensors==0.20.1 loguru==0.7.3 psutil==7.2.2 trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 \
            dill==0.4.1 multiprocess==0.70.19; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .device/whl-after34 "$spec"
done
ls -la .device/whl-after34
