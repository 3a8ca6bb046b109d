#!/usr/bin/env bash
# Put into .device/ what bench/h200_generate.sh needs and a bare GPU host (Python 3.12, torch, transformers) may
# lack: the server's packages (FastAPI, uvicorn and their dependencies, httpx for the load clients), pytest (the
# GPU test) and xxhash (mmtrain's checkpoint checksums import it), at the versions in /work/main/.venv; plus the
# HF anchor script.
# Run here, where pip can download; then carry=[".device"] (a few MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-/work/main/.venv/bin/pip}
mkdir -p .device/whl
for spec in fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 \
    h11==0.16.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20 certifi==2026.10.19.post1 click==8.5.1 xxhash==4.1.0 \
    opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0; do
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .device/whl "$spec"
done
cp ../shared/bench/hf_generate_baseline.py .device/ 2>/dev/null || cp /work/shared/bench/hf_generate_baseline.py .device/
ls .device/whl
