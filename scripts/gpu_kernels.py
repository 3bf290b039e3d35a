"""The FlashInfer kernel modules the GPU check loads, and their build in one parallel ninja run.

``scripts/gpu_check.py --parts prebuild --kernels fa2|fa3`` builds them (phase 1 of
``scripts/gpu_phase.py``, docs/gpu.md); phase 2 checks they are in the cache before it runs.
"""

from __future__ import annotations

import time
from itertools import product

import torch

from engine.worker import kv_quant

HEAD_DIM = 128  # one head size keeps FlashInfer's JIT variants few
# (query heads, kv heads, per-layer sliding windows)
ATTENTION_CONFIGS = [(32, 8, (None, 64)), (16, 8, (None,))]
# (query heads, kv heads) of gpu_check's fp8 part: Llama-3-8B's and the check model's
FP8_SHAPES = [(32, 8), (16, 4)]


def kernel_specs(family: str) -> list:
    """The kernel modules of ``family`` (fa2 or fa3) that scripts/gpu_check.py,
    scripts/bench_gpu.py, scripts/check_cuda_graphs.py and tests/test_attention.py's CUDA tests
    load: bf16, head_dim 128; (query heads, KV heads, windows) of ATTENTION_CONFIGS, the check
    model (16/4), Llama-3-8B (32/8) and the tests (8/2, a sliding layer). CUDA-core decode modules (query
    groups under 4) have no FA3 form and belong to fa2."""
    from engine.worker.attention.flashinfer import jit_specs

    shapes = [*ATTENTION_CONFIGS, (16, 4, (None,)), (32, 8, (None,)), (8, 2, (None, 5))]
    specs = {}
    for heads, kv_heads, windows in shapes:
        tensor_cores = heads // kv_heads >= 4
        found = jit_specs(torch.bfloat16, HEAD_DIM, [w is not None for w in windows],
                          tensor_cores, family, family)
        if family == "fa3" and not tensor_cores:
            found = [spec for spec in found if "fa3" in spec.name]
        specs |= {spec.name: spec for spec in found}
    if family == "fa2":  # the fp8 part: fp8 KV runs on FA2 only, at its check shapes
        for (heads, kv_heads), kv_dtype in product(FP8_SHAPES, kv_quant.FP8_DTYPES):
            found = jit_specs(torch.bfloat16, HEAD_DIM, [False], heads // kv_heads >= 4,
                              "fa2", "fa2", kv_dtype)
            specs |= {spec.name: spec for spec in found}
    return list(specs.values())


def fa3_built() -> bool:
    return all(spec.is_compiled for spec in kernel_specs("fa3"))


def prebuild_kernels(family: str) -> bool:
    """Every ``family`` module the GPU check's parts load, built in one parallel ninja run."""
    from flashinfer.jit import build_jit_specs, env

    print(f"## FlashInfer {family.upper()} kernels (JIT, built in parallel)\n")
    specs = kernel_specs(family)
    cached = sum(spec.is_compiled for spec in specs)
    print(f"{len(specs)} modules, {cached} already in the cache ({env.FLASHINFER_JIT_DIR})",
          flush=True)
    for spec in specs:
        print(f"- {spec.name}")
    start = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    print(f"\nbuilt in {time.perf_counter() - start:.1f} s\n", flush=True)
    return all(spec.is_compiled for spec in specs)
