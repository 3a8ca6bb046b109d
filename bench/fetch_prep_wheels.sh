#!/usr/bin/env bash
# Put into .device/ what bench/prep_device.sh needs and a bare GPU host lacks (run here, where pip can download
# and the Megatron-LM mirror is). The host is assumed to have Python 3.12 with sentencepiece, transformers,
# tokenizers, pillow, numpy, torch and torchaudio (and their own dependencies). Found by running every command
# of the benchmark under `python -S` with only those packages on the path and adding what was missing:
#   six 1.17.0               Megatron-LM's tools/preprocess_data.py imports it (through megatron.core)
#   av 18.1.0                PyAV: mmtrain-prep media validates audio/video with it
#   webdataset 1.0.2         the hand-written reference pipeline (ShardWriter loop) ...
#   braceexpand 0.1.7        ... and its one dependency
#   megatron-energon 7.4.1   ... and `energon prepare` (its other declared dependencies are not imported by
#                            `prepare` on a local folder; installed with --no-deps)
# Versions are the ones in the project's .venv. Also exported (git archive, no history):
#   .device/megatron-lm              Megatron-LM core_v0.16.1 megatron/ + tools/ (the version of the
#                                    megatron-core the tests use; still has the pure-Python GPT-2 BPE)
#   .device/megatron-lm-head.tar.gz  the mirror's newest commit, same folders (needs Python 3.12; its
#                                    GPT2BPETokenizer runs on transformers)
# Carry them with: carry=[".device"]  (about 50 MB: the av wheel is most of it; TEXT_ONLY=1 fetches only
# what the text benchmark needs, a few MB). PARQUET=1 adds pyarrow 26.0.1 (~45 MB: use it with TEXT_ONLY=1 to
# stay under the 64 MiB carry) for the text benchmark's Parquet rows (prep_device.sh PARQUET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
MIRROR=${MEGATRON_MIRROR:-../.mirror/NVIDIA+Megatron-LM/repo}  # where the fetch tool puts it, beside the checkout
mkdir -p "$DEV"/whl
SPECS="six==1.17.0"
[ "${TEXT_ONLY:-0}" = 1 ] || SPECS="$SPECS av==18.1.0 webdataset==1.0.2 braceexpand==0.1.7 megatron-energon==7.4.1"
[ "${PARQUET:-0}" = 1 ] && SPECS="$SPECS pyarrow==26.0.1"
for spec in $SPECS; do
  "$PIP" download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEV"/whl "$spec"
done
rm -rf "$DEV"/megatron-lm && mkdir -p "$DEV"/megatron-lm
git --git-dir="$MIRROR" archive core_v0.16.1 megatron tools | tar -x -C "$DEV"/megatron-lm
git --git-dir="$MIRROR" archive --format=tar.gz -o "$DEV"/megatron-lm-head.tar.gz HEAD megatron tools
ls -la "$DEV"/whl && du -sh "$DEV"/*
