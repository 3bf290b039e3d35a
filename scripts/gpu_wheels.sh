#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels the GPU machine lacks into ./wheels
# (ignored by git; carried to the device with `carry: ["wheels"]`), for its Python 3.12 on
# x86-64 Linux. scripts/gpu_check.sh installs them there with --no-index --no-deps.
#
#     bash scripts/gpu_wheels.sh && du -sh wheels     # the device carries 64 MiB in all
#
# The GPU image already has torch, transformers, tokenizers, safetensors, numpy, jinja2,
# prometheus-client, httpx, h11, anyio and tqdm; it lacks these. flashinfer-python 0.6.1 needs
# apache-tvm-ffi (>=0.1.6,<0.2, not 0.1.8) beside it; its other dependencies (cutlass-dsl,
# cudnn-frontend) are not needed by the paged attention wrappers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p wheels
"$PYTHON" -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    msgspec pyzmq uvicorn starlette "flashinfer-python==0.6.1" \
    "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8"
ls -l wheels
