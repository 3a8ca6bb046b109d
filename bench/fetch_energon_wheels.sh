#!/usr/bin/env bash
# Put into .device/whl what the energon media loader needs and a bare GPU host lacks (run here, where pip can
# download), for bench/h200_vlm_pack.sh. The host has Python 3.12 with torch, torchaudio, transformers (and its
# dependencies: pyyaml, filelock, packaging, tqdm, ...), numpy, pillow and sentencepiece. The list was found by
# running `bench/vlm_pack_h200.py --tiny` in a venv that sees only those packages plus these wheels:
#   megatron-energon 7.4.1, webdataset 1.0.2, braceexpand     the loader and the shard format
#   multi-storage-client 1.3.1 and what it imports: opentelemetry-api, jsonschema (+ referencing, rpds-py,
#     jsonschema-specifications, attrs), python-dateutil, six, lark, wcmatch, bracex, xattr (+ cffi, pycparser),
#     psutil, prettytable, wcwidth, jmespath, tzdata, pyroute2
#   filetype, mfusepy, rapidyaml, deprecation, wrapt        energon's own imports
#   xxhash                                                  mmtrain's checksums (also in the other runners)
# Versions are the ones in the project's .venv (the suite's). Installed with --no-deps. About 12 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
mkdir -p "$DEV"/whl
for spec in megatron-energon==7.4.1 webdataset==1.0.2 braceexpand==0.1.7 multi-storage-client==1.3.1 \
    opentelemetry-api==1.45.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 attrs==26.1.0 python-dateutil==2.9.0.post0 six==1.17.0 lark==1.3.1 wcmatch==10.2.1 \
    bracex==3.2.3 xattr==1.3.0 cffi==2.1.1 pycparser==3.12 psutil==7.2.2 prettytable==3.18.0 wcwidth==0.9.4 \
    jmespath==1.1.0 tzdata==2025.3 pyroute2==0.9.7 filetype==1.2.0 mfusepy==3.1.1 rapidyaml==0.15.2 \
    deprecation==2.1.0 wrapt==2.5.2 xxhash==4.1.0; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEV"/whl "$spec"
done
ls "$DEV"/whl && du -sh "$DEV"/whl
