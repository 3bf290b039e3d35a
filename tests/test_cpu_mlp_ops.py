"""The compiled elementwise ops of a decoder layer (``silu_mul``, csrc/silu_mul.cpp;
``add_rms_norm``, csrc/rms_norm.cpp) in every build of the kernels (tests/test_cpu_kernels.py)
against float64, and the model's use of them (engine/worker/model/layer_ops.py): the op on CPU
rows, torch's ops elsewhere, the same values to the dtype's rounding."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_kernels
from engine.worker.model import layer_ops
from tests.test_cpu_kernels import VARIANTS, load_variants
from tests.test_cpu_norm_rope import torch_rms_norm

# the rounding of one result to each dtype: half a unit in the last place, relative (at most)
HALF_ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
# an absolute allowance: a float16 result under 2^-14 is subnormal (its rounding is absolute);
# below g = -88.3 the vectorised loops give ~0 (under 4e-37), not g e^g
TINY = {torch.float32: 1e-33, torch.bfloat16: 1e-33, torch.float16: 2.0**-14}


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Each element within one rounding of the float64 value (plus float32 math's few ulp)."""
    err = (got.double() - want).abs()
    bound = want.abs() * (HALF_ULP[dtype] + 2.0**-21) + TINY[dtype]
    assert bool((err <= bound).all()), (err / bound).max().item()


def silu_mul_case(rows: int, width: int, dtype: torch.dtype, seed: int,
                  stride_pad: int = 0) -> torch.Tensor:
    """Gate/up rows of a real MLP's range (|x| up to ~20), extremes included: 0, -0, very
    negative gates (SiLU ~ 0), large positive ones, rows with a padded stride."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * width + stride_pad, generator=gen) * 4
    x = x[:, :2 * width]
    if rows and width:
        x[0, 0], x[-1, width - 1] = 0.0, -0.0
        x[rows // 2, : min(width, 3)] = torch.tensor([-100.0, -30.0, 25.0])[: min(width, 3)]
    return x.to(dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 1536), (256, 1536), (37, 24), (5, 1), (3, 17)])
def test_silu_mul_rounds_the_exact_product_once(variants, variant, dtype, rows, width) -> None:
    """At SmolLM2-135M's width (1536) for a decode row and a step of 256, and at odd widths
    (a vector's tail), strided rows included: silu(gate) * up within one rounding."""
    x = silu_mul_case(rows, width, dtype, seed=rows + width, stride_pad=3)
    got = variants[variant].silu_mul(x)
    assert got.dtype == dtype and got.shape == (rows, width) and got.is_contiguous()
    assert_rounded_once(got, silu_mul_reference(x), dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_huge_negative_gates_is_zero(variants, variant, dtype) -> None:
    """Gates far below -88 (up to the dtype's largest magnitude) have a SiLU of ~0 whatever
    their size, at a vector's columns and at its tail (40 columns); a NaN gate stays NaN."""
    gates = torch.tensor([-3e38, -1e38, -1e30, -1e10, -1e4, -100.0, -88.5, float("nan")])
    gate = gates.repeat(5)
    x = torch.cat([gate, torch.full_like(gate, 3.0)])[None].to(dtype)
    got = variants[variant].silu_mul(x)[0].double()
    want = silu_mul_reference(x)[0]
    assert got.isnan().equal(gate.isnan())
    finite = ~gate.isnan()
    assert (got[finite] - want[finite]).abs().max().item() < 1e-33


def test_silu_mul_refuses_what_is_not_gate_up_rows(variants) -> None:
    ops = variants["native"]
    with pytest.raises(RuntimeError, match="silu_mul: rows \\[N, 2 \\* width\\]"):
        ops.silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="silu_mul: rows"):
        ops.silu_mul(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.silu_mul(torch.randn(4, 8).double())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32),
                                             (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.float32)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(variants, variant, x_dtype,
                                                           w_dtype) -> None:
    """The residual (a view with a padded row stride) gets exactly torch's float32 add_, and
    the result is the build's rms_norm of it, bit for bit; against float64 as rms_norm is."""
    ops = variants[variant]
    gen = torch.Generator().manual_seed(11)
    for rows, hidden in ((1, 576), (256, 576), (7, 33)):
        residual = (torch.randn(rows, hidden + 5, generator=gen) * 3)[:, :hidden]
        x = (torch.randn(rows, hidden, generator=gen)).to(x_dtype)
        weight = (1 + torch.randn(hidden, generator=gen) / 4).to(w_dtype)
        plain = residual.clone()
        want = ops.rms_norm(plain.add_(x), weight, 1e-5)
        got = ops.add_rms_norm(residual, x, weight, 1e-5)
        assert torch.equal(residual, plain) and torch.equal(got, want)
        exact = torch_rms_norm(plain.double(), weight.double(), 1e-5)
        tolerance = 2e-6 if w_dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(got.double(), exact, rtol=tolerance, atol=tolerance)


def test_add_rms_norm_refuses_mismatched_rows(variants) -> None:
    ops = variants["native"]
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32 residual"):
        ops.add_rms_norm(torch.zeros(3, 8).bfloat16(), torch.zeros(3, 8), weight, 1e-5)
    with pytest.raises(RuntimeError, match="must match the residual"):
        ops.add_rms_norm(torch.zeros(3, 8), torch.zeros(2, 8), weight, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_takes_the_ops_on_cpu_rows_and_torch_without_them(monkeypatch, dtype) -> None:
    """``silu_mul`` and ``add_rms_norm_`` call the compiled ops on CPU rows; with the ops
    unavailable torch's give the same values (the add and norm bit for bit; SiLU * up within
    the two roundings torch's two ops take)."""
    calls = []
    silu_op, add_op = cpu_kernels.silu_mul_op(), cpu_kernels.add_rms_norm_op()
    assert silu_op is not None and add_op is not None
    monkeypatch.setattr(layer_ops, "silu_mul_op", lambda: lambda *a: calls.append(1) or silu_op(*a))
    monkeypatch.setattr(layer_ops, "add_rms_norm_op",
                        lambda: lambda *a: calls.append(2) or add_op(*a))
    gate_up = silu_mul_case(9, 64, dtype, seed=3)
    residual = torch.randn(9, 64)
    x, weight = torch.randn(9, 64).to(dtype), (1 + torch.randn(64) / 4).to(dtype)
    fused_act = layer_ops.silu_mul(gate_up)
    fused_residual = residual.clone()
    fused_norm = layer_ops.add_rms_norm_(fused_residual, x, weight, 1e-5)
    assert calls == [1, 2]
    monkeypatch.setattr(layer_ops, "silu_mul_op", lambda: None)
    monkeypatch.setattr(layer_ops, "add_rms_norm_op", lambda: None)
    plain_act = layer_ops.silu_mul(gate_up)
    plain_residual = residual.clone()
    plain_norm = layer_ops.add_rms_norm_(plain_residual, x, weight, 1e-5)
    assert torch.equal(fused_residual, plain_residual)
    assert torch.equal(fused_norm, plain_norm) or dtype == torch.bfloat16  # sums' order
    torch.testing.assert_close(fused_norm.float(), plain_norm.float(), rtol=2**-7, atol=2**-7)
    want = silu_mul_reference(gate_up)
    assert_rounded_once(fused_act, want, dtype)
    torch.testing.assert_close(plain_act.double(), want, rtol=4 * HALF_ULP[dtype], atol=1e-30)


def test_silu_mul_is_vectorised_or_left_to_torch(variants, monkeypatch) -> None:
    """The model takes the op only from a build with AVX-512 or AVX2 loops: the plain build's
    element-by-element expf is slower than torch's two vectorised ops."""
    monkeypatch.setattr(cpu_kernels, "_ops", lambda: variants["portable"])
    assert cpu_kernels.silu_mul_op.__wrapped__() is None
    monkeypatch.setattr(cpu_kernels, "_ops", lambda: variants["avx2"])
    assert ((cpu_kernels.silu_mul_op.__wrapped__() is not None)
            == variants["avx2"].paged_decode_vectorized())
