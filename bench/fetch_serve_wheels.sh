#!/usr/bin/env bash
# Put into .device/ what bench/h200_generate.sh needs and a bare GPU host (Python 3.12, torch, transformers) may
# lack: the server's packages (FastAPI, uvicorn and their dependencies, httpx for the load clients), pytest (the
# GPU test) and xxhash (mmtrain's checkpoint checksums import it), at the versions in the project's .venv; plus the
# HF anchor script.
# Run here, where pip can download; then carry=[".device"] (a few MB).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/find_venv.sh  # PIP: the repo's .venv (or the main checkout's)
DEV=${DEV:-.device}  # where to put them (bench/make_device_dir.sh points it at a temporary folder)
mkdir -p "$DEV"/whl
for spec in fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 \
    h11==0.16.0 httptools==0.9.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20 certifi==2026.10.19.post1 click==8.5.1 xxhash==4.1.0 \
    opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEV"/whl "$spec"
done
if [ -f ../shared/bench/hf_generate_baseline.py ]; then cp ../shared/bench/hf_generate_baseline.py "$DEV"/
else echo "no ../shared/bench/hf_generate_baseline.py beside this checkout: the HF decode anchor is not copied"; fi
ls "$DEV"/whl
