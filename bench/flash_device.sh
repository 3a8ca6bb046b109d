#!/usr/bin/env bash
# On the GPU host: flash-attn-4 and the CuTe DSL (bench/fetch_flash_wheels.sh made the pieces here) into
# /tmp/fa4site, over two calls made back to back (the machine keeps /tmp while it stays warm):
#   bash bench/flash_device.sh stash     (carry .device/fa4-1): the first piece of the DSL's libraries to /tmp
#   bash bench/flash_device.sh install   (carry .device/fa4-2): the second piece, checksum, unpack, the wheels,
#                                        and an import of flash_attn.cute
# Then: export PYTHONPATH=$(bash bench/flash_device.sh path):$PYTHONPATH  (the DSL's .pth file is not read from
# a --target folder, so its dsl_packages folder goes on the path by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/fa4site
case ${1:-} in
  stash)
    cp .device/fa4-1/libs.part0 /tmp/fa4-libs.part0
    echo "stashed $(stat -c %s /tmp/fa4-libs.part0) bytes; run install in the next call" ;;
  install)
    [ -f /tmp/fa4-libs.part0 ] || { echo "no /tmp/fa4-libs.part0: the machine was given back since stash (run both calls again, back to back)"; exit 1; }
    cat /tmp/fa4-libs.part0 .device/fa4-2/libs.part1 > /tmp/fa4-libs.tar.xz
    echo "$(cat .device/fa4-2/libs.sha256)  /tmp/fa4-libs.tar.xz" | sha256sum -c --quiet
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .device/fa4-2/*.whl
    tar -xJf /tmp/fa4-libs.tar.xz -C "$SITE"  # the cu13 libraries into the DSL's package folder
    PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages python3 -c \
      "import flash_attn.cute.interface, cutlass; print('flash_attn.cute and cutlass import')" ;;
  path) echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages" ;;
  *) echo "usage: bash bench/flash_device.sh stash|install|path"; exit 2 ;;
esac
