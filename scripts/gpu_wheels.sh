#!/usr/bin/env bash
# For a GPU machine without network: download, on a machine with PyPI, the wheels the GPU check
# installs (scripts/gpu_phase.py, docs/gpu.md) into ./wheels (ignored by git), for the GPU
# machine's Python (GPU_PYTHON, default 3.12) on x86-64 Linux; copy wheels/ into the clone there.
# A GPU machine with network needs none of this: `pip install -e '.[gpu]'` installs the same.
#
#     GPU_PYTHON=3.12 bash scripts/gpu_wheels.sh
#
# The check assumes torch, transformers, tokenizers, safetensors, numpy, jinja2,
# prometheus-client, httpx, h11, anyio and tqdm are installed there; these are the rest.
# flashinfer-python 0.6.1 needs apache-tvm-ffi (>=0.1.6,<0.2, not 0.1.8) beside it; its other
# dependencies (cutlass-dsl, cudnn-frontend) are not needed by the paged attention wrappers
# (flashinfer imports them only inside try blocks). Versions are pinned: the ones the engine is
# tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p wheels
"$PYTHON" -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
    --python-version "${GPU_PYTHON:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    msgspec==0.23.0 pyzmq==27.3.0 uvicorn==0.54.0 starlette==1.10.0 \
    flashinfer-python==0.6.1 apache-tvm-ffi==0.1.15.post2
ls -l wheels
total=$(du -cb wheels/*.whl | tail -1 | cut -f1)
echo "wheels/: $((total / 1024)) KiB in all"
