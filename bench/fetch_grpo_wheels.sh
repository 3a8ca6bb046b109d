#!/usr/bin/env bash
# Put into .device/whl-grpo/ what bench/h200_grpo.sh needs for TRL's GRPOTrainer on a GPU host that has torch and
# transformers (5.17) but not TRL: trl, accelerate and psutil, at the versions in the project's .venv, and protobuf
# (transformers' export of the SentencePiece tokenizer for TRL reads the model's settings with it) (about 1.8 MB).
# TRL also imports datasets and pandas; their wheels with pyarrow's are about 68 MB, over what one device call may
# carry, so the bench stands in for them (bench/grpo_h200.py --shim-datasets: the run uses neither).
# Run here, where pip can download; then carry=[".device"] (with .device/whl's xxhash and .device/data).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
mkdir -p "$DEV"/whl-grpo
for spec in trl==1.16.0 accelerate==1.16.0 psutil==7.2.2 protobuf==7.36.2; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEV"/whl-grpo "$spec"
done
ls -la "$DEV"/whl-grpo
