"""Every compiled CPU kernel (engine/worker/csrc/) at every shape a step can produce: no rows,
one row, row counts around each tile width, odd widths and head sizes, in every build
(tests/test_cpu_kernels.py). Hypothesis draws the shapes; each result is checked against the
float64 or torch reference the kernel's own test file uses. A step of no rows is an ordinary
step (the LM head of a step in which no sequence samples: a prompt's chunks mid-prefill, or the
KV of a session turn's last token, which a session computes so that its next turn is a whole
cache hit): it must return empty, never divide by its row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.checkpoints.quant_formats import BLOCK
from engine.worker.attention.base import apply_rope
from engine.worker.kv_quant import dequantize, quantize
from tests.test_cpu_kernels import (
    TOLERANCE,
    VARIANTS,
    load_variants,
    reference,
    verify_reference,
)
from tests.test_cpu_mlp_ops import assert_rounded_once, silu_mul_case, silu_mul_reference
from tests.test_cpu_norm_rope import rope_case, torch_rms_norm
from tests.test_lora_kernel import lora_reference
from tests.test_quant import FORMATS, emulated, random_weight

SHAPES = settings(max_examples=50, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
ROWS = st.integers(0, 40)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


@SHAPES
@given(variant=st.sampled_from(VARIANTS), fmt=st.sampled_from(FORMATS), digits=st.sampled_from([1, 2]),
       rows=ROWS, outs=st.integers(1, 70), blocks=st.integers(1, 6), dtype=DTYPES,
       seed=st.integers(0, 2**16))
@example(variant="native", fmt="q4_1", digits=1, rows=0, outs=49, blocks=5,
         dtype=torch.bfloat16, seed=0)  # the default model's LM head in a step of no rows
@example(variant="native", fmt="q6_k", digits=2, rows=0, outs=49, blocks=5,
         dtype=torch.bfloat16, seed=0)  # a K-quant file's LM head in a step of no rows
@example(variant="avx2", fmt="q4_k", digits=1, rows=9, outs=17, blocks=3,
         dtype=torch.float32, seed=1)
def test_quant_linear_at_any_row_count(variants, variant, fmt, digits, rows, outs, blocks, dtype,
                                       seed) -> None:
    ops = variants[variant]
    p = random_weight(fmt, outs, blocks * BLOCK, seed)
    kernel = ops.quant_repack(*p.repack_args())
    x = torch.randn(rows, blocks * BLOCK, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = ops.quant_linear(x, *kernel, p.bits, outs, digits)
    assert out.shape == (rows, outs) and out.dtype == dtype
    if rows == 0:
        return
    want = emulated(x.float(), p, digits)
    # float32 arithmetic (a second digit's 254ths of a step round at about 1e-5 of the
    # result) against float64; bf16's rounding of the result
    tolerance = 3e-5 if dtype == torch.float32 else 8e-3
    assert (out.double() - want).norm() <= tolerance * want.norm()
    # a row's result does not depend on the rows beside it (which tile width took it)
    row = seed % rows
    alone = ops.quant_linear(x[row : row + 1].contiguous(), *kernel, p.bits, outs, digits)
    assert torch.equal(out[row], alone[0])


def decode_case(heads: int, kv_heads: int, head_dim: int, page_size: int, lens: list[int],
                dtype: torch.dtype, int8: bool, seed: int):
    """Sequences of ``lens`` keys over pages drawn at random from a pool; int8 pages hold each
    row's values and scale, the reference reads them dequantized."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 48
    pages = torch.randn(2, num_pages, page_size, kv_heads, head_dim, generator=gen)
    stored = quantize(pages) if int8 else pages.to(dtype)
    exact = dequantize(stored, torch.float64) if int8 else stored
    counts = [-(-n // page_size) for n in lens]
    indptr = torch.tensor(np.concatenate(([0], np.cumsum(counts))), dtype=torch.int32)
    indices = torch.randint(0, num_pages, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    return stored, exact, indptr, indices, torch.tensor(lens, dtype=torch.int32), gen


HEAD_SHAPES = st.sampled_from([(8, 4, 32), (9, 3, 64), (4, 4, 16), (12, 1, 32), (6, 2, 40),
                               (4, 2, 24), (2, 1, 36)])


@SHAPES
@given(variant=st.sampled_from(VARIANTS), heads=HEAD_SHAPES, page_size=st.sampled_from([1, 5, 16]),
       lens=st.lists(st.integers(1, 70), max_size=40), window=st.sampled_from([0, 3, 17]),
       dtype=DTYPES, int8=st.booleans(), seed=st.integers(0, 2**16))
@example(variant="native", heads=(9, 3, 64), page_size=16, lens=[], window=0,
         dtype=torch.bfloat16, int8=False, seed=0)
def test_paged_decode_at_any_batch(variants, variant, heads, page_size, lens, window, dtype, int8,
                                   seed) -> None:
    num_heads, kv_heads, head_dim = heads
    stored, exact, indptr, indices, seq_lens, gen = decode_case(
        num_heads, kv_heads, head_dim, page_size, lens, dtype, int8, seed)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out, lse = variants[variant].paged_decode(q, stored[0], stored[1], indptr, indices, seq_lens,
                                              window, scale)
    assert out.shape == q.shape and lse.shape == (len(lens), num_heads)
    if not lens:
        return
    want, want_lse = reference(q, exact[0], exact[1], indptr, indices, seq_lens, window, scale)
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=rtol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), heads=HEAD_SHAPES, page_size=st.sampled_from([1, 16]),
       seqs=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 9)), max_size=12),
       dtype=DTYPES, int8=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_verify_at_any_row_count(variants, variant, heads, page_size, seqs, dtype, int8,
                                       seed) -> None:
    """Several query rows a sequence (a verify's K + 1), from none at all to 12 x 9."""
    num_heads, kv_heads, head_dim = heads
    lens = [length for length, _ in seqs]
    rows = [min(n, length) for length, n in seqs]
    stored, exact, indptr, indices, seq_lens, gen = decode_case(
        num_heads, kv_heads, head_dim, page_size, lens, dtype, int8, seed)
    q = torch.randn(sum(rows), num_heads, head_dim, generator=gen).to(dtype)
    q_indptr = torch.tensor(np.concatenate(([0], np.cumsum(rows))), dtype=torch.int32)
    scale = head_dim**-0.5
    out, lse = variants[variant].paged_decode(q, stored[0], stored[1], indptr, indices, seq_lens,
                                              0, scale, None, q_indptr)
    assert out.shape == q.shape
    if not seqs:
        return
    want, want_lse = verify_reference(q, exact[0], exact[1], indptr, indices, seq_lens, q_indptr,
                                      0, scale)
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=rtol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), rows=ROWS, hidden=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_rms_norm_at_any_row_count(variants, variant, rows, hidden, dtype, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    got = variants[variant].rms_norm(x, weight, 1e-6)
    assert got.shape == (rows, hidden) and got.dtype == dtype
    want = torch_rms_norm(x, weight, 1e-6)
    # sums in another order: at most a few units in the last place
    tight = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tight, atol=tight)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), rows=ROWS, width=st.integers(0, 80),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_silu_mul_at_any_row_count(variants, variant, rows, width, dtype, seed) -> None:
    x = silu_mul_case(rows, width, dtype, seed)
    got = variants[variant].silu_mul(x)
    assert got.shape == (rows, width) and got.dtype == dtype
    assert_rounded_once(got, silu_mul_reference(x), dtype)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), rows=ROWS, hidden=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_add_rms_norm_at_any_row_count(variants, variant, rows, hidden, dtype, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, hidden, generator=gen) * 3
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    plain = residual.clone()
    want = variants[variant].rms_norm(plain.add_(x), weight, 1e-6)
    got = variants[variant].add_rms_norm(residual, x, weight, 1e-6)
    assert got.shape == (rows, hidden) and torch.equal(got, want)
    assert torch.equal(residual, plain)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), tokens=ROWS, heads=HEAD_SHAPES,
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), int8=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_store_at_any_row_count(variants, variant, tokens, heads, dtype, int8, seed) -> None:
    num_heads, kv_heads, head_dim = heads
    qk, v, cos, signed_sin = rope_case(tokens, dtype, num_heads, kv_heads, head_dim, seed)
    gen = torch.Generator().manual_seed(seed)
    width = head_dim + 2 if int8 else head_dim
    pool_dtype = torch.int8 if int8 else dtype
    k_slots = torch.zeros(64, kv_heads, width, dtype=pool_dtype)
    v_slots = torch.zeros(64, kv_heads, width, dtype=pool_dtype)
    slots = torch.randperm(64, generator=gen)[:tokens] if tokens <= 64 else None
    if slots is None:  # more tokens than the pool: a pool as large as the step
        k_slots = torch.zeros(tokens, kv_heads, width, dtype=pool_dtype)
        v_slots = torch.zeros_like(k_slots)
        slots = torch.randperm(tokens, generator=gen)
    q = variants[variant].rope_store(qk[:, :num_heads], qk[:, num_heads:], v, cos, signed_sin,
                                     slots, k_slots, v_slots)
    assert q.shape == (tokens, num_heads, head_dim)
    want_q, want_k = apply_rope(qk, cos, signed_sin).split([num_heads, kv_heads], dim=1)
    tight = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(q, want_q, rtol=tight, atol=tight)
    if int8:
        assert torch.equal(v_slots[slots], quantize(v))
        got_k = dequantize(k_slots[slots], torch.float32)
        step = want_k.float().abs().amax(-1, keepdim=True) / 127
        assert ((got_k - want_k.float()).abs() <= 1.5 * step + 1e-6).all()
    else:
        torch.testing.assert_close(k_slots[slots], want_k, rtol=tight, atol=tight)
        assert torch.equal(v_slots[slots], v)
    untouched = torch.ones(len(k_slots), dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


@SHAPES
@given(variant=st.sampled_from(VARIANTS), slots=st.lists(st.integers(-1, 3), max_size=40),
       inputs=st.integers(1, 70), outputs=st.integers(1, 300), rank=st.integers(1, 16),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_lora_bgmv_at_any_row_count(variants, variant, slots, inputs, outputs, rank, dtype,
                                    seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    a_slots = torch.randn(4, rank, inputs, generator=gen).to(dtype)
    b_slots = torch.randn(4, rank, outputs, generator=gen).to(dtype)
    widths = torch.tensor([rank, 0, max(1, rank // 2), rank])
    spans = torch.tensor([0, outputs]).repeat(4, rank, 1)
    row_slots = torch.tensor(slots, dtype=torch.int64)
    x = torch.randn(len(slots), inputs, generator=gen).to(dtype)
    out = torch.randn(len(slots), outputs, generator=gen).to(dtype)
    got = out.clone()
    variants[variant].lora_bgmv(x, a_slots, b_slots, row_slots, widths, spans, got)
    want = lora_reference(x, a_slots, b_slots, row_slots, widths, out)
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    atol = 1e-5 * (want.abs().max().item() if len(slots) else 1.0)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@SHAPES
@given(variant=st.sampled_from(VARIANTS), fmt=st.sampled_from(FORMATS), rows=ROWS,
       outs=st.integers(1, 70), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_dequantize_weight_at_any_row_count(variants, variant, fmt, rows, outs, blocks,
                                            seed) -> None:
    """An embedding lookup of no ids up to 40, through the quantized table."""
    ops = variants[variant]
    p = random_weight(fmt, outs, blocks * BLOCK, seed)
    kernel = ops.quant_repack(*p.repack_args())
    ids = torch.randint(0, outs, (rows,), generator=torch.Generator().manual_seed(seed))
    got = ops.dequantize_weight(*kernel, p.bits, outs, ids, torch.float32)
    assert got.shape == (rows, blocks * BLOCK)
    torch.testing.assert_close(got, p.dequantize()[ids].float(), rtol=1e-6, atol=1e-6)
