#!/usr/bin/env bash
# Put into .device/whl-after34/ what bench/h200_after_training.sh needs beyond the GPU host's image (torch, transformers
# 5.17, pandas, pyarrow...) and .device/whl (pydantic, xxhash, ...): compressed-tensors and its loguru and psutil
# (mmtrain.quantize, the quantized loading), trl and accelerate (TRL's GRPOTrainer), datasets with dill and
# multiprocess (TRL imports datasets; the bench stands in for it, and for pyarrow, when the host lacks them or its
# pyarrow is too old), protobuf (transformers reads a SentencePiece model's settings with it when it exports the
# tokenizer: mmtrain.quantize's folders, TRL's tokenizer; a bare Python 3.12 lacks it). ~3 MB.
# Run here, where pip can download; then carry=[".device"].
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
mkdir -p "$DEV"/whl-after34
for spec in compressed-tensors==0.20.1 loguru==0.7.3 psutil==7.2.2 trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 \
            dill==0.4.1 multiprocess==0.70.19 protobuf==7.36.2; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEV"/whl-after34 "$spec"
done
ls -la "$DEV"/whl-after34
