"""Attention backends over the paged KV pool, chosen by name.

``torch`` runs anywhere; ``flashinfer`` needs CUDA, fp16/bf16 and the flashinfer-python package;
``auto`` takes flashinfer when all of that holds and torch otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import AttentionBackend
from engine.attention.flashinfer import FlashInferBackend
from engine.attention.torch_native import TorchNativeBackend
from engine.kv_pool import KVPool

BACKENDS = ("auto", "torch", "flashinfer")

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "FlashInferBackend",
    "TorchNativeBackend",
    "make_backend",
    "resolve_backend",
]


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend ``name`` means on this device and dtype."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "torch"
    return "flashinfer"


def make_backend(
    name: str,
    pool: KVPool,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_windows: Sequence[int | None],
) -> AttentionBackend:
    shape = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_windows=sliding_windows,
    )
    resolved = resolve_backend(name, pool.device, pool.kv.dtype)
    if resolved == "flashinfer":
        return FlashInferBackend(pool, **shape)
    return TorchNativeBackend(pool, **shape)
