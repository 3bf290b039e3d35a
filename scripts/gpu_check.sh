#!/usr/bin/env bash
# GPU check in one command, on a CUDA machine with python3 + torch and no network:
#   bash scripts/gpu_check.sh [gpu_check.py options]
# Installs the wheels brought along in ./wheels (made here by scripts/gpu_wheels.sh: flashinfer-python
# 0.6.1 with apache-tvm-ffi, msgspec, pyzmq, uvicorn, starlette; 12 MB), then runs
# scripts/gpu_check.py (flashinfer vs torch attention parity, decode timings, ModelRunner on a
# random Llama) and the CUDA tests of tests/test_attention.py when pytest is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

shopt -s nullglob
wheels=(wheels/*.whl)
if ((${#wheels[@]})); then
    echo "installing ${#wheels[@]} wheel(s) from wheels/ (no network, no dependency resolution)"
    "$PYTHON" -m pip install --quiet --no-index --no-deps "${wheels[@]}"
fi

"$PYTHON" - <<'PY'
import importlib
import sys

missing = []
for name in ("torch", "numpy", "msgspec", "safetensors", "flashinfer"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # an import can fail with more than ImportError (e.g. a bad .so)
        missing.append(f"  {name}: {type(exc).__name__}: {exc}")
if missing:
    sys.exit("gpu_check cannot start; these imports fail (bring wheels for them in ./wheels):\n"
             + "\n".join(missing))
import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check needs CUDA, and torch.cuda.is_available() is False")
PY

"$PYTHON" scripts/gpu_check.py "$@"

if "$PYTHON" -c "import pytest" 2>/dev/null; then
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_attention.py
else
    echo "pytest not installed: skipped tests/test_attention.py"
fi
