"""8-bit KV: what ``--kv-cache-dtype`` means, and the int8 format the pool and kernels share.

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
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
QMAX = 127
_FP16_MAX = 65504.0

_FULL = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores for ``--kv-cache-dtype name`` with a model in ``model_dtype``;
    a ValueError naming what to use instead for what cannot run."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"--kv-cache-dtype {name} is not available: radixserve has no fp8 KV "
                         "kernels yet; use --kv-cache-dtype int8 (about the same capacity, on "
                         "the torch attention backend) or auto")
    if name not in _FULL:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; choose auto, bfloat16, float16, "
                         "float32 or int8")
    if _FULL[name] != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(f"--kv-cache-dtype {name} differs from the model's dtype ({model}): a "
                         "full-precision cache is kept in the model's dtype; use "
                         f"--dtype {name}, or --kv-cache-dtype auto or int8")
    return model_dtype


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of the pool: the scale's bytes ride in int8 rows."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [..., D] (any float dtype) as int8 rows [..., D + 2] with their scales."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_(max=_FP16_MAX).half()
    divisor = scale.float()
    values = torch.where(divisor > 0, wide / divisor, torch.zeros_like(wide))
    values = values.round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 2] back to values [..., D] in ``dtype`` (exact in float32)."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale.contiguous().view(torch.float16).float()
    return (values.float() * scale).to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [...] of int8 rows [..., D + 2]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float().squeeze(-1)
