#!/usr/bin/env bash
# GPU check in one command, on a CUDA machine with python3 + torch and no network:
#
#     bash scripts/gpu_check.sh     # the log and JSON numbers also in $OUT
#
# With the kernels already built it takes a few minutes. The first run compiles FlashInfer's
# kernels (minutes on 16 cores; the "kernels" step is capped at 240 s); they are kept in
# ./.flashinfer-cache, an ignored folder the device keeps between calls while it stays warm, so
# if that first run runs out of time, run it again: it continues from what was built.
#
# Brought along (made here by scripts/gpu_wheels.sh, carried as the ignored ./wheels): the
# wheels the GPU image lacks (flashinfer-python 0.6.1 with apache-tvm-ffi, msgspec, pyzmq,
# uvicorn, starlette; 12 MB). Steps, each bounded by its own timeout so one hang cannot eat the
# device time:
#   1. versions, and the backends the engine would choose there;
#   2. install the wheels offline (--no-index --no-deps);
#   3. scripts/gpu_check.py: FlashInfer kernels prebuilt in parallel (timed; kept in
#      ./.flashinfer-cache, so a second run in the same machine session compiles nothing),
#      flashinfer vs torch attention parity (prefill, decode, mixed, cached prefix,
#      copy-on-write; page sizes 1 and 16), decode FA2 vs FA3; then scripts/check_cuda_graphs.py:
#      CUDA graphs vs eager (runner and engine greedy tokens identical);
#   4. scripts/bench_gpu.py at Llama-3-8B's shapes (decode vs the HBM floor, prefill, prefix
#      caching on vs off), eager and with CUDA graphs, numbers also as JSON in $OUT;
#   5. the CUDA tests of tests/test_attention.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.flashinfer-cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0
step() {  # step SECONDS NAME COMMAND...: run it under a timeout, remember a failure
    local limit=$1 name=$2
    shift 2
    echo
    echo "=== $name ($(date +%T), limit ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    ((rc == 0)) || status=1
    return $rc
}

shopt -s nullglob
wheels=(wheels/*.whl)
if ((${#wheels[@]})); then
    step 45 "install ${#wheels[@]} wheel(s) from wheels/" \
        "$PYTHON" -m pip install --quiet --no-index --no-deps "${wheels[@]}"
fi

step 30 "versions and chosen backends" "$PYTHON" - <<'PY' || exit 1
import importlib
import platform
import sys

missing = []
for name in ("torch", "numpy", "msgspec", "zmq", "safetensors", "flashinfer"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # an import can fail with more than ImportError (e.g. a bad .so)
        missing.append(f"  {name}: {type(exc).__name__}: {exc}")
if missing:
    sys.exit("gpu_check cannot start; these imports fail (bring wheels for them in ./wheels):\n"
             + "\n".join(missing))
import flashinfer
import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check needs CUDA, and torch.cuda.is_available() is False")
from importlib.metadata import version

from engine.worker.attention import resolve_backend

print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}),"
      f" flashinfer {flashinfer.__version__}, apache-tvm-ffi {version('apache-tvm-ffi')}")
cuda = torch.device("cuda")
for head_dim in (64, 128, 32):
    print(f"attention backend auto, bfloat16, head_dim {head_dim}: "
          f"{resolve_backend('auto', cuda, torch.bfloat16, head_dim)}")
print("decode on tensor cores (query groups >= 4): fa2 unless --flashinfer-decode-backend says")
PY

step 240 "kernels" "$PYTHON" scripts/gpu_check.py --parts prebuild
step 120 "parity and decode timings" "$PYTHON" scripts/gpu_check.py --parts parity,decode
step 120 "CUDA graphs vs eager" "$PYTHON" scripts/check_cuda_graphs.py
step 180 "bench_gpu.py, CUDA graphs" "$PYTHON" scripts/bench_gpu.py --enable-cuda-graph \
    --json "$OUT/bench_gpu_graphs.json"
step 60 "bench_gpu.py, eager decode" "$PYTHON" scripts/bench_gpu.py --skip-engine \
    --json "$OUT/bench_gpu_eager.json"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    step 60 "tests/test_attention.py (CUDA)" "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/test_attention.py
fi
echo
echo "gpu_check: $([[ $status == 0 ]] && echo "all steps passed" || echo "SOME STEPS FAILED")"
exit $status
