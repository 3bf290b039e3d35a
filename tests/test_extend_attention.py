"""The compiled extend kernel (csrc/extend_attention.cpp) against float64 references, and the
torch backend's use of it: bf16 extends, where the CPU and torch's oneDNN offer a bf16 brgemm
(AMX or AVX-512 BF16) and the build has AVX-512 BF16."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine.contracts.step import BatchInput
from engine.worker.attention import TorchNativeBackend, torch_native
from engine.worker.cpu_kernels import extend_attention_op, paged_decode_op
from tests.test_attention import KV_HEADS, make_pool, random_batch
from tests.test_cpu_kernels import random_case, variants, verify_reference  # noqa: F401

pytestmark = pytest.mark.skipif(
    extend_attention_op() is None,
    reason="this CPU or torch build has no bf16 brgemm (neither AMX nor AVX-512 BF16)")

# bf16 outputs of values ~1: the kernel's two roundings (weights, output) and the reference's.
TOLERANCE = 2e-2
# (keys, query rows) per sequence: a question over a cached head, prefills from position 0 (one
# row tile, several), rows and keys on and around the 32-row tiles and 32 / 256-key blocks.
EXTEND_SHAPES = [(544, 32), (18, 18), (100, 40), (300, 300), (530, 257), (33, 20), (1000, 70),
                 (289, 33)]


def extend_case(heads, kv_heads, head_dim, page_size):
    seq_lens = [n for n, _ in EXTEND_SHAPES]
    rows = [r for _, r in EXTEND_SHAPES]
    _, k_pages, v_pages, indptr, indices, lens = random_case(
        heads, kv_heads, head_dim, page_size, seq_lens, torch.bfloat16)
    q = torch.randn(sum(rows), heads, head_dim, generator=torch.Generator().manual_seed(3))
    q_indptr = torch.tensor(np.concatenate(([0], np.cumsum(rows))), dtype=torch.int32)
    return (q.bfloat16(), k_pages, v_pages, indptr, indices, lens), q_indptr, rows


@functools.cache
def extend_references(heads, kv_heads, head_dim, page_size, window):
    """(starts, output, log-sum-exp) in float64, without starts and with each sequence's
    keys starting somewhere before its first row's."""
    case, q_indptr, rows = extend_case(heads, kv_heads, head_dim, page_size)
    starts = torch.tensor([max(0, min((7 * n) // 10, n - r)) for n, r in EXTEND_SHAPES],
                          dtype=torch.int32)
    return [(given, *verify_reference(*case, q_indptr, window, head_dim**-0.5, given))
            for given in (None, starts)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (4, 4, 32),
                                                     (16, 2, 128)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5, 100])
def test_kernel_matches_float64_reference(heads, kv_heads, head_dim, page_size, window) -> None:
    case, q_indptr, _ = extend_case(heads, kv_heads, head_dim, page_size)
    op = extend_attention_op()
    before = torch.get_num_threads()
    try:
        for given, want, want_lse in extend_references(heads, kv_heads, head_dim, page_size,
                                                       window):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got, lse = op(*case, window, head_dim**-0.5, given, q_indptr)
                assert got.dtype == torch.bfloat16 and got.shape == case[0].shape
                assert lse.dtype == torch.float32 and lse.shape == got.shape[:2]
                err = (got.double() - want).abs().max().item()
                assert err < TOLERANCE, (threads, given is not None, err)
                assert (lse.double() - want_lse).abs().max().item() < 1e-4
    finally:
        torch.set_num_threads(before)


def test_kernel_refuses_what_it_cannot_read(variants) -> None:  # noqa: F811
    (q, k, v, indptr, indices, seq_lens), q_indptr, _ = extend_case(8, 2, 64, 16)
    op = extend_attention_op()
    with pytest.raises(RuntimeError, match="bf16 queries and pages"):
        op(q.float(), k.float(), v.float(), indptr, indices, seq_lens, 0, 1.0, None, q_indptr)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), indptr,
           indices, seq_lens, 0, 1.0, None, q_indptr)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, v, indptr, indices + k.shape[0], seq_lens, 0, 1.0, None, q_indptr)
    with pytest.raises(RuntimeError, match="end at q's"):
        op(q[:-1].contiguous(), k, v, indptr, indices, seq_lens, 0, 1.0, None, q_indptr)
    # The builds for CPUs without AVX-512 have no extend kernel: those extends take SDPA.
    assert variants["native"].extend_attention_available()
    assert not variants["avx2"].extend_attention_available()
    assert not variants["portable"].extend_attention_available()


def extend_backend(pool, deterministic: bool = False) -> TorchNativeBackend:
    return TorchNativeBackend(pool, num_heads=8, num_kv_heads=KV_HEADS, head_dim=64,
                              sliding_windows=(None, 5), deterministic=deterministic)


def batch_reference(attention: TorchNativeBackend, layer: int, batch: BatchInput,
                    q: torch.Tensor) -> torch.Tensor:
    """Every row of the step in float64, from the pool the step wrote."""
    k_pages, v_pages = attention.pool.layer(layer)
    q_indptr = torch.tensor(np.concatenate(([0], np.cumsum(batch.extend_lens))),
                            dtype=torch.int32)
    return verify_reference(q, k_pages, v_pages, torch.from_numpy(batch.page_indptr),
                            torch.from_numpy(batch.page_indices),
                            torch.from_numpy(batch.seq_lens), q_indptr,
                            attention.sliding_windows[layer] or 0, attention.scale)[0]


def step_inputs(batch: BatchInput, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch.num_tokens, n, 64, generator=gen).bfloat16()
                 for n in (8, KV_HEADS, KV_HEADS))


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_extends_through_the_kernel(page_size, monkeypatch) -> None:
    """A mixed step (decodes, verify-shaped extends, questions over cached heads, a prefill
    from position 0): extends past the decode kernel's rows take the extend kernel, those past
    ``EXTEND_KERNEL_MAX_ROWS`` (40 here) gather + SDPA, decodes and short extends keep the
    decode kernel, --deterministic keeps every row on the decode kernel; each agrees with the
    float64 reference on both layers (one windowed), as gather + SDPA does."""
    monkeypatch.setattr(torch_native, "EXTEND_KERNEL_MAX_ROWS", 40)
    pool = make_pool(page_size, dtype=torch.bfloat16, head_dim=64)
    shapes = [(30, 1), (0, 7), (128, 32), (40, 20), (0, 64), (60, 17), (16, 18)]
    batch = random_batch(page_size, pool.num_pages, shapes)
    q, k, v = step_inputs(batch, 1)
    kernel, deterministic = extend_backend(pool), extend_backend(pool, deterministic=True)
    sdpa = extend_backend(pool)
    sdpa._extend_attention = None
    for layer in range(2):
        for attention in (kernel, sdpa, deterministic):
            attention.plan(batch)
            got = attention.forward(layer, q, k, v)
            want = batch_reference(attention, layer, batch, q)
            assert (got.double() - want).abs().max().item() < TOLERANCE, layer
        kinds = sorted((g.num_seqs, g.kernel is not None, g.paged is None)
                       for g in kernel._groups)
        # the 64-row prefill; decodes and short extends; the rest
        assert kinds == [(1, False, True), (3, False, False), (3, True, False)]
        assert all(g.kernel is None for g in deterministic._groups + sdpa._groups)
    assert paged_decode_op() is not None


def test_questions_over_one_shared_head_take_no_cascade() -> None:
    """A wave of questions over one cached head: the extend kernel reads the head per
    sequence (faster than the cascade's SDPA over it once: docs/benchmarks.md), and matches
    the reference; gather + SDPA takes the cascade."""
    page_size = 16
    pool = make_pool(page_size, dtype=torch.bfloat16, head_dim=64)
    head, free = list(range(0, 16)), iter(range(16, pool.num_pages))
    seqs = [(head + [next(free) for _ in range(3)], 256, np.arange(20 + 4 * m))
            for m in range(4)]
    batch = BatchInput.build(seqs, page_size, "all")
    q, k, v = step_inputs(batch, 2)
    kernel, sdpa = extend_backend(pool), extend_backend(pool)
    kernel.sliding_windows = sdpa.sliding_windows = (None, None)
    sdpa._extend_attention = None
    for attention, cascade in ((kernel, False), (sdpa, True)):
        attention.plan(batch)
        got = attention.forward(0, q, k, v)
        (group,) = attention._groups
        assert (group.cascade is not None) == cascade
        want = batch_reference(attention, 0, batch, q)
        assert (got.double() - want).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("window,start", [(50, None), (0, 211)])
def test_keys_before_every_rows_window_or_start_are_never_read(window, start) -> None:
    """Pages wholly before the tile's first visible key (a sliding layer's dropped pages, the
    part before a start) hold NaN here; the kernel reads none of them, also the block's keys
    between its 32-aligned start and the first visible key."""
    seq_len, rows, page_size = 300, 40, 16
    gen = torch.Generator().manual_seed(6)
    k_pages, v_pages = (torch.randn(32, page_size, 2, 64, generator=gen).bfloat16()
                        for _ in range(2))
    first_visible = seq_len - rows - (window - 1 if window else 0) if start is None else start
    k_pages[: first_visible // page_size] = float("nan")
    v_pages[: first_visible // page_size] = float("nan")
    case = (torch.randn(rows, 8, 64, generator=gen).bfloat16(), k_pages, v_pages,
            torch.tensor([0, 19], dtype=torch.int32), torch.arange(19, dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32))
    q_indptr = torch.tensor([0, rows], dtype=torch.int32)
    starts = None if start is None else torch.tensor([start], dtype=torch.int32)
    got, _ = extend_attention_op()(*case, window, 0.125, starts, q_indptr)
    want, _ = verify_reference(*case, q_indptr, window, 0.125, starts)
    assert not got.isnan().any()
    assert (got.double() - want).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("seq_len,rows", [(32, 32), (96, 40), (160, 160)])
def test_a_rows_block_max_is_its_own_scores(seq_len, rows) -> None:
    """A tile's last row sees every key of its last block (32, 96 or 160 keys: a multiple of
    32, not of 64): its softmax's max is over those keys only, not over the next folded row's
    scores (here another head's, ~200 above this head's, which underflowed every weight of the
    row to 0: NaN), and a head's rows do not change with the other head's queries."""
    gen = torch.Generator().manual_seed(8)
    page_size, pages = 16, -(-seq_len // 16)
    k_pages, v_pages = (torch.randn(pages, page_size, 1, 64, generator=gen).bfloat16()
                        for _ in range(2))
    q = torch.randn(rows, 2, 64, generator=gen)
    case = [q.bfloat16(), k_pages, v_pages, torch.tensor([0, pages], dtype=torch.int32),
            torch.arange(pages, dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)]
    q_indptr = torch.tensor([0, rows], dtype=torch.int32)
    quiet, _ = extend_attention_op()(*case, 0, 0.125, None, q_indptr)
    q[:, 1] *= 100  # head 1's scores far above head 0's
    case[0] = q.bfloat16()
    got, lse = extend_attention_op()(*case, 0, 0.125, None, q_indptr)
    want, want_lse = verify_reference(*case, q_indptr, 0, 0.125, None)
    assert not got.isnan().any()
    assert (got.double() - want).abs().max().item() < TOLERANCE
    assert (lse.double() - want_lse).abs().max().item() < 1e-3 * want_lse.abs().max().item()
    assert torch.equal(got[:, 0], quiet[:, 0])


def test_sliding_layers_own_pages_through_the_kernel() -> None:
    """A pool whose windowed layer keeps its KV in pages of its own: the step's sliding view
    lists page 0 (NaN here) for the pages before every window, which the kernel never reads;
    the layer's rows match the float64 reference over the sliding pages."""
    import msgspec

    from engine.worker.kv_pool import KVPool

    page_size, window = 16, 5
    pool = KVPool(num_layers=2, num_pages=32, page_size=page_size, num_kv_heads=KV_HEADS,
                  head_dim=64, dtype=torch.bfloat16, device="cpu", sliding_layers=(False, True),
                  num_sliding_pages=24)
    pool.kv.normal_()
    shapes = [(128, 32), (40, 20), (0, 64)]
    batch = random_batch(page_size, pool.num_pages, shapes)
    rng = np.random.default_rng(3)
    free = list(rng.permutation(np.arange(1, 24)))
    swa_pages = []
    for (cached, _), count in zip(shapes, np.diff(batch.page_indptr), strict=True):
        first = max(cached - window + 1, 0) // page_size  # before every row's window
        swa_pages.append([0] * first + [int(free.pop()) for _ in range(count - first)])
    k_sliding, _ = pool.layer(1)
    k_sliding[0] = float("nan")
    pool.layer(1)[1][0] = float("nan")
    slots = [swa_pages[b][p // page_size] * page_size + p % page_size
             for b, (cached, new) in enumerate(shapes) for p in range(cached, cached + new)]
    batch = msgspec.structs.replace(
        batch, swa_page_indices=np.concatenate(swa_pages).astype(np.int32),
        swa_out_slots=np.array(slots, dtype=np.int64))
    q, k, v = step_inputs(batch, 4)
    attention = extend_backend(pool)
    attention.plan(batch)
    got = attention.forward(1, q, k, v)
    assert any(g.kernel is not None for g in attention._groups)
    want = batch_reference(attention, 1, batch.sliding_view(), q)
    assert not got.isnan().any()
    assert (got.double() - want).abs().max().item() < TOLERANCE
