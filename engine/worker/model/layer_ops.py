"""The row-wise steps of a decoder layer around its products: RMSNorm, the residual additions
(into the float32 stream, engine/worker/model/llama.py) and SiLU(gate) * up. On CPU rows each
is one compiled op (engine/worker/cpu_kernels.py) where torch takes two to six, which a step of
a few hundred rows pays in dispatch more than in arithmetic; elsewhere torch's ops, with the
same arithmetic (SiLU * up: the compiled op rounds once, torch's rounds the SiLU first).
Every op here computes each row alone, so a row's result never depends on the rows beside it
(``--deterministic``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.cpu_kernels import add_rms_norm_op, rms_norm_op, silu_mul_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` (float32 residual rows, or activations) in the weight's dtype. Rows on
    CPU take the compiled op (engine/worker/cpu_kernels.py): the same arithmetic in one call."""
    if x.dim() == 2 and x.is_cpu and x.stride(1) == 1:
        fused = rms_norm_op()
        if fused is not None:
            return fused(x, weight, eps)
    if weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in float32 and scale in the model dtype, as transformers' RMSNorm does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(weight.dtype)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """residual += x (the float32 stream, in place), then ``rms_norm`` of the sum: on CPU rows
    one compiled op, the same arithmetic as the two (the add in float32, then the norm)."""
    if (residual.is_cpu and residual.dtype == torch.float32
            and residual.dim() == 2 and residual.stride(1) == 1 and x.stride(1) == 1):
        fused = add_rms_norm_op()
        if fused is not None:
            return fused(residual, x, weight, eps)
    return rms_norm(residual.add_(x), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the fused product's two halves, in its dtype: on CPU one compiled
    pass that rounds once (engine/worker/cpu_kernels.py), else torch's silu and mul_."""
    if gate_up.is_cpu and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        fused = silu_mul_op()
        if fused is not None:
            return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def add_linear_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """residual += x @ weight.T (+ bias), in place: one GEMM accumulating into the residual
    when both share a dtype, else the product (in the weights' dtype) added to it."""
    if bias is None and residual.dtype == x.dtype:
        return residual.addmm_(x, weight.t())
    return residual.add_(F.linear(x, weight, bias))
