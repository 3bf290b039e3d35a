"""Attention over int8 pages: the compiled decode kernel (every build) and the torch backend's
extend, decode and cascade paths against float64 attention over the dequantized values; the
compiled rotary + store op quantizing as kv_quant.quantize does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.worker.attention import TorchNativeBackend, torch_native
from engine.worker.attention.base import apply_rope
from engine.worker.kv_pool import KVPool
from engine.worker.kv_quant import dequantize, quantize, scales
from tests.test_attention import SHAPES, random_batch, reference_attention
from tests.test_cpu_kernels import TOLERANCE, VARIANTS, load_variants, reference
from tests.test_cpu_norm_rope import rope_case


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def int8_case(num_heads, num_kv, head_dim, page_size, seq_lens, dtype, seed=0):
    """Pages of int8 rows drawn at random from a pool (shared between sequences), with scales
    that differ per row."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 64 if page_size > 1 else 1024
    spread = torch.rand(2, num_pages, page_size, num_kv, 1, generator=gen) * 4 + 0.1
    pages = quantize(torch.randn(2, num_pages, page_size, num_kv, head_dim, generator=gen)
                     * spread)
    counts = [-(-n // page_size) for n in seq_lens]
    indptr = torch.tensor(np.concatenate(([0], np.cumsum(counts))), dtype=torch.int32)
    indices = torch.randint(0, num_pages, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, pages[0], pages[1], indptr, indices, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(8, 4, 32), (9, 3, 64), (8, 1, 64), (12, 1, 32), (4, 4, 16)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_kernel_on_int8_pages_matches_float64_over_dequantized_values(
        variants, variant, dtype, heads, kv_heads, head_dim, page_size, window) -> None:
    # Lengths on and around page and 16-key block edges (partial last pages), and a long one.
    seq_lens = [1, 15, 16, 17, 33, 200]
    q, k, v, indptr, indices, lens = int8_case(heads, kv_heads, head_dim, page_size, seq_lens,
                                               dtype)
    scale = head_dim**-0.5
    starts = torch.tensor([0, 3, 0, 16, 5, 100], dtype=torch.int32) if not window else None
    out, lse = variants[variant].paged_decode(q, k, v, indptr, indices, lens, window, scale,
                                              starts)
    want, want_lse = reference(q, dequantize(k, torch.float64), dequantize(v, torch.float64),
                               indptr, indices, lens, window, scale, starts)
    assert out.dtype == dtype
    # bf16 outputs round to 8 bits of mantissa, relative to values spread up to ~4x.
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=rtol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


def test_decode_kernel_refuses_int8_rows_without_their_scales(variants) -> None:
    q, k, v, indptr, indices, lens = int8_case(8, 4, 32, 16, [20, 3], torch.float32)
    with pytest.raises(RuntimeError, match="2-byte scale"):
        variants["native"].paged_decode(q, k[..., :32].contiguous(), v[..., :32].contiguous(),
                                        indptr, indices, lens, 0, 1.0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("head_dim", [64, 36])  # 36: runs of 8 values, then 4 one at a time
def test_rope_store_quantizes_as_kv_quant_does(variants, variant, dtype, tokens,
                                               head_dim) -> None:
    qk, v, cos, signed_sin = rope_case(tokens, dtype, head_dim=head_dim)
    v[0, 0] = 0  # a row of zeros: scale 0
    want_q, want_k = apply_rope(qk, cos, signed_sin).split([8, 4], dim=1)
    k_slots = torch.zeros(1000, 4, head_dim + 2, dtype=torch.int8)
    v_slots = torch.zeros(1000, 4, head_dim + 2, dtype=torch.int8)
    slots = torch.randperm(1000)[:tokens]
    q = variants[variant].rope_store(qk[:, :8], qk[:, 8:], v, cos, signed_sin, slots, k_slots,
                                     v_slots)
    tight = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(q, want_q, rtol=tight, atol=tight)
    assert torch.equal(v_slots[slots], quantize(v))
    # K is rotated as torch rotates it (to its last place), then quantized the same way.
    got_k, want_k = k_slots[slots], quantize(want_k)
    torch.testing.assert_close(scales(got_k), scales(want_k), rtol=2**-10, atol=0)
    assert (got_k[..., :head_dim].int() - want_k[..., :head_dim].int()).abs().max() <= 1
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def int8_pool(page_size: int, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(num_layers=2, num_pages=512 // page_size, page_size=page_size,
                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device="cpu",
                  kv_dtype=torch.int8)
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(*pool.kv.shape[:-1], HEAD_DIM, generator=gen)
    pool.kv.copy_(quantize(values * (torch.rand(*pool.kv.shape[:-1], 1, generator=gen) + 0.5)))
    return pool


def dequantized(pool: KVPool) -> KVPool:
    """A float64 pool holding ``pool``'s dequantized values, for the reference."""
    twin = KVPool(num_layers=2, num_pages=pool.num_pages, page_size=pool.page_size,
                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float64, device="cpu")
    twin.kv.copy_(dequantize(pool.kv, torch.float64))
    return twin


def backend(pool: KVPool, compiled: bool) -> TorchNativeBackend:
    attention = TorchNativeBackend(pool, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                   head_dim=HEAD_DIM, sliding_windows=(None, 5),
                                   compiled=compiled)
    assert (attention._paged_decode is not None) == compiled  # int8: the kernel on any build
    return attention


def step_tensors(num_tokens: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(num_tokens, h, HEAD_DIM, generator=gen).to(dtype)
            for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_backend_on_int8_pages_matches_float64_over_dequantized_values(
        variants, compiled, page_size, shape) -> None:
    """Prefills, extends over cached pages and decodes (through the kernel, or gathered and
    dequantized page by page), a windowed layer among them: this step's K and V are quantized
    into the pool, and attention reads every key as its dequantized value."""
    pool = int8_pool(page_size)
    batch = random_batch(page_size, pool.num_pages, SHAPES[shape])
    attention = backend(pool, compiled)
    attention.plan(batch)
    slots = torch.from_numpy(batch.out_slots.astype(np.int64))
    for layer in range(2):
        q, k, v = step_tensors(batch.num_tokens, torch.float32)
        out = attention.forward(layer, q, k, v)
        k_slots, v_slots = pool.slots(layer)
        assert torch.equal(k_slots[slots], quantize(k)) and torch.equal(v_slots[slots],
                                                                        quantize(v))
        want = reference_attention(dequantized(pool), layer, batch, q.double())
        torch.testing.assert_close(out.double(), want.double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("decode", [True, False])
def test_cascade_over_int8_shared_prefixes_matches_float64(variants, monkeypatch,
                                                           decode) -> None:
    """Two groups sharing 48- and 24-token heads and a loner, as decodes (the kernel on own
    parts) and as 3-token extends (both parts gathered and dequantized): the cascade runs and
    agrees with float64 over the dequantized values."""
    from engine.contracts.step import BatchInput

    monkeypatch.setattr(torch_native, "CASCADE_MIN_SAVED_KEYS", 0)
    page_size = 4
    pool = int8_pool(page_size)
    heads = [list(range(0, 12)), list(range(12, 18))]
    seqs, free = [], iter(range(40, pool.num_pages))
    new = [7] if decode else [7, 8, 9]
    for g, members in enumerate((5, 3)):
        for m in range(members):
            own = [next(free) for _ in range(2 + (m + g) % 3)]
            cached = len(heads[g]) * page_size + len(own) * page_size - 3 - m % 2
            seqs.append((heads[g] + own, cached, new))
    seqs.append(([next(free) for _ in range(6)], 17, new))
    batch = BatchInput.build(seqs, page_size)
    attention = backend(pool, True)
    attention.sliding_windows = (None, None)
    attention.plan(batch)
    group = attention._groups[0]
    assert group.cascade is not None and group.cascade.num_groups == 2
    assert (group.cascade.own_paged is not None) == decode
    q, k, v = step_tensors(batch.num_tokens, torch.float32)
    out = attention.forward(0, q, k, v)
    want = reference_attention(dequantized(pool), 0, batch, q.double())
    torch.testing.assert_close(out.double(), want.double(), atol=2e-5, rtol=0)


def test_bf16_model_over_int8_pages_stays_within_bf16_rounding(variants) -> None:
    pool = int8_pool(16, torch.bfloat16)
    batch = random_batch(16, pool.num_pages, SHAPES["mixed"])
    attention = backend(pool, True)
    attention.plan(batch)
    q, k, v = step_tensors(batch.num_tokens, torch.bfloat16)
    out = attention.forward(0, q, k, v)
    want = reference_attention(dequantized(pool), 0, batch, q.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want.double(), atol=3e-2, rtol=0)
