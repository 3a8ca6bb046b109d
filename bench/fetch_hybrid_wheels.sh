#!/usr/bin/env bash
# Put into .device/ what bench/h200_hybrid.sh needs and a bare GPU host (Python 3.12, torch 2.11, Triton 3.6,
# transformers 5.17) lacks: fla-core 0.6.0 and einops 0.8.2 (the hybrid family's GPU scan; pure Python) into
# .device/whl, which the h200 scripts install into /tmp/site; transformers 5.24.0 into .device/whl-transformers,
# installed by h200_hybrid.sh for its transformers stage only (its other needs -- huggingface-hub >= 1.31,
# tokenizers 0.23, safetensors >= 0.8 -- the device has: 1.33, 0.23.2, 0.8.0); mamba-ssm 2.3.2.post1 built here
# from its sdist without its CUDA extension (MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE: a pure-Python wheel
# of its Triton kernels, what ssd_mamba.py loads) into .device/whl-mamba.
# Run here, where pip can download; then carry=[".device"] (about 15 MB more).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
get() {  # folder spec
  mkdir -p "$1"
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "$2"
}
get "$DEV"/whl fla-core==0.6.0
get "$DEV"/whl einops==0.8.2
get "$DEV"/whl-transformers transformers==5.24.0
# its setup.py imports torch (hence no build isolation: this venv's) and wheel (put on the path for the build only)
build_tools=$(mktemp -d)
"$PIP" install -q --target "$build_tools" wheel
mkdir -p "$DEV"/whl-mamba
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE PYTHONPATH=$build_tools "$PIP" wheel -q --no-cache-dir --no-deps \
  --no-build-isolation --no-binary :all: -w "$DEV"/whl-mamba mamba-ssm==2.3.2.post1
rm -rf "$build_tools"
ls -la "$DEV"/whl-transformers "$DEV"/whl-mamba && ls "$DEV"/whl && du -sh "$DEV"
