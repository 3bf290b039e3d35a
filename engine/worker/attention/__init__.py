"""Attention backends over the paged KV pool, chosen by name.

``torch`` runs anywhere; ``flashinfer`` needs CUDA, fp16/bf16, a head size its kernels are built
for (64, 128 or 256) and the flashinfer-python package; ``auto`` takes flashinfer when all of
that holds and it warms up (JIT-compiles and runs a prefill and a decode), and torch otherwise,
saying why in the log.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from engine.worker.attention.base import AttentionBackend
from engine.worker.attention.flashinfer import FLASHINFER_HEAD_DIMS, FlashInferBackend
from engine.worker.attention.torch_native import TorchNativeBackend
from engine.worker.kv_pool import KVPool

logger = logging.getLogger("radixserve.attention")

BACKENDS = ("auto", "torch", "flashinfer")

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "FlashInferBackend",
    "TorchNativeBackend",
    "make_backend",
    "resolve_backend",
]


def flashinfer_installed() -> bool:
    """Whether the package is there to import (importing it is ``FlashInferBackend``'s job)."""
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype,
                    head_dim: int | None = None, kv_dtype: torch.dtype | None = None) -> str:
    """The concrete backend ``name`` means on this device, model dtype, head size and KV dtype
    (default: the model's)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "flashinfer" and kv_dtype == torch.int8:
        raise ValueError("FlashInfer has no int8 KV cache: use --kv-cache-dtype fp8_e4m3 (the "
                         "same capacity, FlashInfer's fp8 kernels), or --attention-backend torch "
                         "with --kv-cache-dtype int8")
    if name != "auto":
        return name
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or (
            kv_dtype == torch.int8):
        return "torch"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        logger.info("attention backend auto: head_dim %d has no FlashInfer kernels (%s); torch",
                    head_dim, ", ".join(map(str, FLASHINFER_HEAD_DIMS)))
        return "torch"
    return "flashinfer" if flashinfer_installed() else "torch"


def make_backend(name: str, pool: KVPool, *, decode_backend: str = "fa2",
                 graph_max_batch: int = 0, deterministic: bool = False,
                 **shape) -> AttentionBackend:
    """The backend ``name`` resolves to, over ``pool``, of ``shape`` (``AttentionBackend``'s
    num_heads, num_kv_heads, head_dim, sliding_windows and scale); flashinfer's kernels are built and
    warmed up here (``decode_backend``: its decode kernel on tensor cores; ``graph_max_batch``:
    the largest CUDA-graph batch its workspace must hold; see
    engine/worker/attention/flashinfer.py). ``deterministic``: the torch backend's
    batch-invariant plan, which needs the compiled CPU kernel (ValueError elsewhere)."""
    resolved = resolve_backend(name, pool.device, pool.dtype, shape["head_dim"], pool.kv_dtype)
    if deterministic:
        backend = TorchNativeBackend(pool, deterministic=True, **shape)
        if not backend.deterministic:
            raise ValueError("--deterministic needs the compiled CPU attention kernel, which "
                             "this device, KV dtype or build does not have (the log says why)")
        return backend
    if resolved == "torch":
        return TorchNativeBackend(pool, **shape)
    try:
        backend = FlashInferBackend(pool, decode_backend=decode_backend,
                                    graph_max_batch=graph_max_batch, **shape)
        backend.warm_up()
    except Exception as exc:
        if name == "flashinfer":
            raise
        # auto: a mismatched install fails at import with more than ImportError, a kernel that
        # does not compile fails at its first plan or run; either way torch serves instead.
        logger.warning("attention backend auto: flashinfer failed to start (%s: %s); using torch",
                       type(exc).__name__, exc)
        return TorchNativeBackend(pool, **shape)
    return backend
