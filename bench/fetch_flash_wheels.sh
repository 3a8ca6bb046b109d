#!/usr/bin/env bash
# Put into .device/ what train.document_attention=flex_flash needs on the GPU host (Python 3.12, torch 2.11 cu130;
# cuda-bindings, cuda-pathfinder, einops and protobuf are there already): flash-attn-4 (FlexAttention's FLASH
# backend imports flash_attn.cute) and NVIDIA's CuTe DSL in its CUDA 13 flavour. That flavour's compiler library
# alone is a 92 MB wheel (xz: ~64 MB), over what one call carries (64 MiB with the working tree), so it travels
# unpacked and xz-compressed in two pieces, one call each, and bench/flash_device.sh joins them there:
#   .device/fa4-1/libs.part0                        call 1: bash bench/flash_device.sh stash
#   .device/fa4-2/{libs.part1,libs.sha256,*.whl}    call 2: bash bench/flash_device.sh install (then the bench)
# The machine must stay warm between the two calls (it goes back after 30 s idle): make them back to back.
# Run here, where pip can download (~3 min: xz on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}
SPECS="flash-attn-4==4.0.0b40 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
nvidia-cutlass-dsl-libs-cu13==4.8.1"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
# shellcheck disable=SC2086
"$PIP" download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$t/whl" $SPECS
mkdir -p "$t/libs"
unzip -q "$t"/whl/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$t/libs"
rm "$t"/whl/nvidia_cutlass_dsl_libs_cu13-*.whl
tar -C "$t/libs" -cf - . | xz -9 -T2 > "$t/libs.tar.xz"
split -b 58000000 -d -a 1 "$t/libs.tar.xz" "$t/libs.part"
mkdir -p "$t/fa4-1" "$t/fa4-2"
mv "$t/libs.part0" "$t/fa4-1/"
mv "$t/libs.part1" "$t"/whl/*.whl "$t/fa4-2/"
(cd "$t" && sha256sum libs.tar.xz | cut -d' ' -f1) > "$t/fa4-2/libs.sha256"
mkdir -p "$DEV"
for d in fa4-1 fa4-2; do rm -rf "${DEV:?}/$d"; mv "$t/$d" "$DEV/$d"; done
du -sh "$DEV"/fa4-1 "$DEV"/fa4-2
