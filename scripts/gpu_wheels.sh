#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels the GPU machine lacks into ./wheels
# (ignored by git; carried to the device with `carry: ["wheels"]`), for its Python 3.12 on
# x86-64 Linux. scripts/gpu_phase.py installs them there (docs/gpu.md) with --no-index --no-deps.
#
#     bash scripts/gpu_wheels.sh && du -sh wheels     # the device carries 64 MiB in all
#
# The GPU image already has torch, transformers, tokenizers, safetensors, numpy, jinja2,
# prometheus-client, httpx, h11, anyio and tqdm; it lacks these. flashinfer-python 0.6.1 needs
# apache-tvm-ffi (>=0.1.6,<0.2, not 0.1.8) beside it; its other dependencies (cutlass-dsl,
# cudnn-frontend) are not needed by the paged attention wrappers (flashinfer imports them only
# inside try blocks). Versions are pinned: the ones this project was tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p wheels
"$PYTHON" -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    msgspec==0.23.0 pyzmq==27.3.0 uvicorn==0.54.0 starlette==1.10.0 \
    flashinfer-python==0.6.1 apache-tvm-ffi==0.1.15.post2
ls -l wheels
# The device carries 64 MiB in all (wheels + the working tree): keep the wheels under 60.
total=$(du -cb wheels/*.whl | tail -1 | cut -f1)
if ((total >= 60 * 1024 * 1024)); then
    echo "wheels/ holds $((total / 1024 / 1024)) MiB, over the 60 MiB budget: remove stale wheels" >&2
    exit 1
fi
echo "wheels/: $((total / 1024)) KiB in all (budget 60 MiB)"
