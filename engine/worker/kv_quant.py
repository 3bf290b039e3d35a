"""8-bit KV: what ``--kv-cache-dtype`` means, and the 8-bit formats the pool and kernels share.

An int8 pool stores each (token, KV head) row of K or V as ``head_dim`` int8 values followed by
its scale, a float16 in the row's last two bytes::

    row = [ q_0 q_1 ... q_{D-1} | scale (float16, 2 bytes) ]      value_d = q_d * scale

Symmetric quantization: ``scale = fp16(max |x_d| / 127)``, ``q_d = round(x_d / scale)``
(half to even) clamped to +-127; a row of zeros has scale 0. The scale lives inside the row, so
every copy, swap, fork and shard of a page moves its scales with its values: nothing that moves
page bytes can drop them. A float16 scale costs 2 bytes per row (3% for head_dim 64, where a
float32 one would take the page count below 1.9x bf16's); ``value_d`` is exact in float32
(8 bits times 11).

The compiled ``rope_store`` op quantizes this way as it stores (engine/worker/csrc/), the
compiled ``paged_decode`` dequantizes in registers, and ``quantize`` / ``dequantize`` below are
the torch forms of both (the torch paths, and the tests' reference).

fp8 (``fp8_e4m3``: float8_e4m3fn, 3 mantissa bits, up to 448; ``fp8_e5m2``: 2 bits, up to
57,344) stores each value cast to the 8-bit float with one scale for the whole cache, 1.0 (as
vLLM does when a checkpoint brings no KV scales): values past the format's range saturate.
This is the layout FlashInfer's fp8 paged kernels read (a scale per tensor, none per row). The
pool keeps fp8 pages as their bytes (uint8, ``storage_dtype``): CPU torch has no indexed copy
for fp8 tensors, and every copy, swap and shard moves bytes anyway; ``encode`` / ``decode``
turn rows into and out of that form.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
QMAX = 127
_FP16_MAX = 65504.0

_FULL = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(_FP8.values())


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores for ``--kv-cache-dtype name`` with a model in ``model_dtype``;
    a ValueError naming what to use instead for what cannot run."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name in _FP8:
        return _FP8[name]
    if name not in _FULL:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; choose auto, bfloat16, float16, "
                         "float32, int8, fp8_e4m3 or fp8_e5m2")
    if _FULL[name] != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(f"--kv-cache-dtype {name} differs from the model's dtype ({model}): a "
                         "full-precision cache is kept in the model's dtype; use "
                         f"--dtype {name}, or --kv-cache-dtype auto or int8")
    return model_dtype


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of the pool: the scale's bytes ride in int8 rows."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pool's tensor for a cache of ``kv_dtype``: fp8's bytes as uint8."""
    return torch.uint8 if kv_dtype in FP8_DTYPES else kv_dtype


def encode(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` [..., D] in the pool's stored form for ``kv_dtype`` (``storage_dtype``)."""
    if kv_dtype == torch.int8:
        return quantize(x)
    if kv_dtype in FP8_DTYPES:
        limit = torch.finfo(kv_dtype).max
        return x.clamp(-limit, limit).to(kv_dtype).view(torch.uint8)
    return x.to(kv_dtype)


def decode(rows: torch.Tensor, kv_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows of a ``kv_dtype`` cache back to values [..., D] in ``dtype``."""
    if kv_dtype == torch.int8:
        return dequantize(rows, dtype)
    if kv_dtype in FP8_DTYPES:
        return rows.view(kv_dtype).to(dtype)
    return rows.to(dtype)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [..., D] (any float dtype) as int8 rows [..., D + 2] with their scales."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_(max=_FP16_MAX).half()
    divisor = scale.float()
    values = torch.where(divisor > 0, wide / divisor, torch.zeros_like(wide))
    values = values.round_().clamp_(-QMAX, QMAX).to(torch.int8)
    # flattened first: a step of no rows gives the scales a zero stride, which no dtype view
    # takes
    scale_bytes = scale.reshape(-1).view(torch.int8).view(*scale.shape[:-1], SCALE_BYTES)
    return torch.cat([values, scale_bytes], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 2] back to values [..., D] in ``dtype`` (exact in float32)."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale.contiguous().view(torch.float16).float()
    return (values.float() * scale).to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [...] of int8 rows [..., D + 2]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float().squeeze(-1)
