"""The compiled CPU kernels (engine/worker/csrc/) against float64 references, in this CPU's build,
the AVX2 build that CPUs without AVX-512 take and the portable build that CPUs with neither
take; and the engine's use of them."""

from __future__ import annotations

import concurrent.futures
import functools
import logging

import numpy as np
import pytest
import torch

from engine.worker import cpu_kernels
from engine.worker.attention import TorchNativeBackend
from engine.worker.cpu_kernels import ENV_SWITCH, paged_decode_op
from engine.worker.kv_pool import KVPool
from tests.test_attention import make_pool, random_batch, reference_attention

VARIANTS = list(cpu_kernels.VARIANTS)


def load_variants() -> dict[str, object]:
    """Every build of the kernels, loaded side by side: variant -> its torch.ops namespace."""
    others = [variant for variant in VARIANTS if variant != "native"]
    with concurrent.futures.ThreadPoolExecutor(len(others)) as pool:  # each compiles alone
        builds = pool.map(cpu_kernels.build, others)
        assert cpu_kernels._ops() is not None, "the compiled kernels did not build here (see the log)"
        for library in list(builds):
            torch.ops.load_library(str(library))
    return {variant: getattr(torch.ops, cpu_kernels.ops_namespace(variant)) for variant in VARIANTS}


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def reference(q, k_pages, v_pages, indptr, indices, seq_lens, window, scale, starts=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 softmax attention of each sequence's one query over its keys (from
    ``starts[b]`` on, if given), and each row's log-sum-exp of the scaled scores."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k_pages.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float64)
    for b in range(num_seqs):
        pages = indices[indptr[b]: indptr[b + 1]].long()
        length = int(seq_lens[b])
        first = max(0, length - window) if window else 0
        if starts is not None:
            first = max(first, int(starts[b]))
        k = k_pages[pages].reshape(-1, num_kv, head_dim)[first:length].double()
        v = v_pages[pages].reshape(-1, num_kv, head_dim)[first:length].double()
        k = k.repeat_interleave(num_heads // num_kv, dim=1)
        v = v.repeat_interleave(num_heads // num_kv, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        out[b] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        lse[b] = scores.logsumexp(-1)
    return out, lse


def random_case(num_heads, num_kv, head_dim, page_size, seq_lens, dtype, seed=0):
    """Pages drawn at random from a pool (shared between sequences, as prefix hits are)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 64 if page_size > 1 else 1024
    k_pages = torch.randn(num_pages, page_size, num_kv, head_dim, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, page_size, num_kv, head_dim, generator=gen).to(dtype)
    counts = [-(-n // page_size) for n in seq_lens]
    indptr = torch.tensor(np.concatenate(([0], np.cumsum(counts))), dtype=torch.int32)
    indices = torch.randint(0, num_pages, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_pages, v_pages, indptr, indices, torch.tensor(seq_lens, dtype=torch.int32)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# Lengths on and around page and 16-key block edges, and a long one.
DECODE_SEQ_LENS = [1, 15, 16, 17, 33, 200]


@functools.cache
def decode_references(dtype, heads, kv_heads, head_dim, page_size, window
                      ) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """(starts, output, log-sum-exp) of the decode case of these parameters in float64,
    without starts and with each sequence's keys starting somewhere before its last. A case's
    inputs follow from its parameters, so every build is checked against one computation."""
    case = random_case(heads, kv_heads, head_dim, page_size, DECODE_SEQ_LENS, dtype)
    starts = torch.tensor([(7 * n) // 10 for n in DECODE_SEQ_LENS], dtype=torch.int32)
    return [(given, *reference(*case, window, head_dim**-0.5, given)) for given in (None, starts)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(8, 4, 32), (9, 3, 64), (4, 4, 16), (32, 8, 128), (6, 2, 40), (8, 1, 64), (14, 2, 16),
     (12, 1, 32)],  # groups 1-8 compile to fixed-size loops; 12 takes the general ones (AVX2:
)                   # runs of 8 and 4); head_dim 40 is 8-wide in the AVX-512 build too
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5, 40])
def test_kernel_matches_float64_reference(variants, variant, dtype, heads, kv_heads, head_dim,
                                          page_size, window) -> None:
    case = random_case(heads, kv_heads, head_dim, page_size, DECODE_SEQ_LENS, dtype)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    try:
        for given, want, want_lse in decode_references(dtype, heads, kv_heads, head_dim,
                                                       page_size, window):
            for threads in (1, 2):  # one item per sequence, or sequences split by KV heads
                torch.set_num_threads(threads)
                got, lse = variants[variant].paged_decode(*case, window, scale, given)
                assert got.dtype == dtype and got.shape == case[0].shape
                assert lse.dtype == torch.float32 and lse.shape == got.shape[:2]
                err = (got.double() - want).abs().max().item()
                assert err < TOLERANCE[dtype], (threads, err)
                # The scores come from inputs rounded to the KV dtype either way; fp32 sums.
                assert (lse.double() - want_lse).abs().max().item() < 1e-4
    finally:
        torch.set_num_threads(before)


def verify_reference(q, k_pages, v_pages, indptr, indices, seq_lens, q_indptr, window, scale,
                     starts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference`` for several query rows a sequence: row j of sequence b is its token at
    position seq_len - n_b + j, attending the keys up to it (the keys a decode step with that
    token last would see)."""
    outs, lses = [], []
    for b in range(len(seq_lens)):
        rows = int(q_indptr[b + 1] - q_indptr[b])
        for j in range(rows):
            length = int(seq_lens[b]) - rows + j + 1
            out, lse = reference(q[int(q_indptr[b]) + j][None], k_pages, v_pages,
                                 indptr[b: b + 2] - indptr[b],
                                 indices[int(indptr[b]): int(indptr[b + 1])],
                                 torch.tensor([length]), window, scale,
                                 None if starts is None else starts[b: b + 1])
            outs.append(out)
            lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


VERIFY_SEQ_LENS = [1, 15, 16, 17, 33, 200, 40, 18]
VERIFY_ROWS = [1, 3, 6, 1, 9, 17, 4, 17]


def verify_case(heads, kv_heads, head_dim, page_size, dtype):
    """Sequences verifying 1 (a decode) to 17 tokens, on and around page and block edges."""
    case = random_case(heads, kv_heads, head_dim, page_size, VERIFY_SEQ_LENS, dtype)
    q_indptr = torch.tensor(np.concatenate(([0], np.cumsum(VERIFY_ROWS))), dtype=torch.int32)
    q = torch.randn(sum(VERIFY_ROWS), heads, head_dim, generator=torch.Generator().manual_seed(5))
    return (q.to(dtype), *case[1:]), q_indptr, VERIFY_ROWS


@functools.cache
def verify_references(dtype, heads, kv_heads, head_dim, page_size, window
                      ) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """(starts, output, log-sum-exp) of the verify case of these parameters in float64, without
    and with starts; computed once for every build, as ``decode_references``."""
    case, q_indptr, rows = verify_case(heads, kv_heads, head_dim, page_size, dtype)
    starts = torch.tensor([max(0, min((7 * n) // 10, n - r))
                           for n, r in zip(VERIFY_SEQ_LENS, rows, strict=True)], dtype=torch.int32)
    return [(given, *verify_reference(*case, q_indptr, window, head_dim**-0.5, given))
            for given in (None, starts)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (12, 1, 32),
                                                     (6, 2, 40), (4, 4, 16)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5])
def test_verify_rows_match_float64_reference(variants, variant, dtype, heads, kv_heads,
                                             head_dim, page_size, window) -> None:
    """Several query rows a sequence (``q_indptr``), causal among the sequence's last tokens,
    with and without a window and starts: each row is the attention of its own position."""
    case, q_indptr, _ = verify_case(heads, kv_heads, head_dim, page_size, dtype)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    try:
        for given, want, want_lse in verify_references(dtype, heads, kv_heads, head_dim,
                                                       page_size, window):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got, lse = variants[variant].paged_decode(*case, window, scale, given, q_indptr)
                assert got.dtype == dtype and got.shape == case[0].shape
                assert lse.dtype == torch.float32 and lse.shape == got.shape[:2]
                assert (got.double() - want).abs().max().item() < TOLERANCE[dtype]
                assert (lse.double() - want_lse).abs().max().item() < 1e-4
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (12, 1, 32),
                                                     (6, 2, 40)])
def test_verify_rows_are_the_decode_rows_bit_for_bit(variants, variant, dtype, heads, kv_heads,
                                                     head_dim) -> None:
    """Without a sliding window, each verify row's output and log-sum-exp equal those of a
    one-row decode step of that token (its sequence cut after it): the same sums in the same
    order, whatever the rows beside it."""
    case, q_indptr, rows = verify_case(heads, kv_heads, head_dim, 16, dtype)
    q, k_pages, v_pages, indptr, indices, seq_lens = case
    op = variants[variant].paged_decode
    got, lse = op(*case, 0, 0.125, None, q_indptr)
    for b, count in enumerate(rows):
        for j in range(count):
            row = int(q_indptr[b]) + j
            length = int(seq_lens[b]) - count + j + 1
            pages = indices[int(indptr[b]): int(indptr[b]) + -(-length // 16)]
            one, one_lse = op(q[row: row + 1].contiguous(), k_pages, v_pages,
                              torch.tensor([0, len(pages)], dtype=torch.int32),
                              pages.contiguous(), torch.tensor([length], dtype=torch.int32), 0,
                              0.125)
            assert torch.equal(got[row], one[0]) and torch.equal(lse[row], one_lse[0]), (b, j)


def test_kernel_refuses_what_it_cannot_read(variants) -> None:
    q, k, v, indptr, indices, seq_lens = random_case(8, 4, 32, 16, [20, 3], torch.float32)
    op = variants["native"].paged_decode
    with pytest.raises(RuntimeError, match="int32 indptr"):
        op(q, k, v, indptr.long(), indices, seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="in q's dtype or int8"):
        op(q.bfloat16(), k, v, indptr, indices, seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, v, indptr, indices + k.shape[0], seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="has 40 keys but 2 pages of 16"):
        op(q, k, v, indptr, indices, seq_lens * 2, 0, 1.0)
    with pytest.raises(RuntimeError, match="leave its sequence a key"):
        op(q, k, v, indptr, indices, seq_lens, 0, 1.0, torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="head sizes disagree"):
        op(q[:, :6].contiguous(), k, v, indptr, indices, seq_lens, 0, 1.0)
    rows = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32 q_indptr"):
        op(q, k, v, indptr, indices, seq_lens, 0, 1.0, None, rows.long())
    with pytest.raises(RuntimeError, match="end at q's 2 rows"):
        op(q, k, v, indptr, indices, seq_lens, 0, 1.0, None, torch.tensor([0, 1, 3],
                                                                            dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 1 has 4 query rows for 3 keys"):
        op(torch.cat([q, q, q[:1]]), k, v, indptr, indices, seq_lens, 0, 1.0, None,
           torch.tensor([0, 1, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="leave its sequence a key"):  # row 0 of 2 at 18
        op(torch.cat([q, q[:1]]), k, v, indptr, indices, seq_lens, 0, 1.0,
           torch.tensor([19, 0], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32 q_indptr"):
        op(q, k, v, indptr, indices, seq_lens, 0, 1.0, None,
           torch.tensor([0, 1, 2], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="end at q's 2 rows"):
        op(q, k, v, indptr, indices, seq_lens, 0, 1.0, None,
           torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 1 has 4 query rows for 3 keys"):
        op(torch.cat([q, q, q[:1]]), k, v, indptr, indices, seq_lens, 0, 1.0, None,
           torch.tensor([0, 1, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="leave its sequence a key"):  # rows at 18 and 19
        op(torch.cat([q, q[:1]]), k, v, indptr, indices, seq_lens, 0, 1.0,
           torch.tensor([19, 0], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"weight \[hidden\]"):
        variants["native"].rms_norm(q[0], torch.ones(5), 1e-6)


def backend(pool: KVPool, compiled: bool) -> TorchNativeBackend:
    """The torch backend with the compiled kernels, or with none. ``compiled``: the decode
    kernel too, also on a CPU where the engine would not pick it (neither AVX-512 nor AVX2)."""
    attention = TorchNativeBackend(pool, num_heads=8, num_kv_heads=2, head_dim=16,
                                   sliding_windows=(None, 5), compiled=compiled)
    if compiled:
        attention._paged_decode = torch.ops.radixserve.paged_decode
    return attention


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decodes_through_the_kernel_as_the_sdpa_path_does(variants, page_size,
                                                                  dtype) -> None:
    """A mixed step (decodes and short extends, verify-shaped, among a long extend, so the
    kernel's group is a subset of the rows), a step of decodes and short extends only, and a
    decode-only step: the kernel and gather + SDPA agree, on both layers (one windowed)."""
    for shapes in ([(30, 1), (0, 7), (47, 1), (5, 3), (40, 20), (16, 1), (100, 17)],
                   [(30, 1), (0, 7), (90, 6)], [(30, 1), (47, 1), (0, 1)]):
        pool = make_pool(page_size, dtype=dtype)
        batch = random_batch(page_size, pool.num_pages, shapes)
        compiled, plain = backend(pool, True), backend(pool, False)
        assert compiled._paged_decode is not None and plain._paged_decode is None
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(batch.num_tokens, 8, 16, generator=gen).to(dtype)
        k = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(dtype)
        v = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(dtype)
        for layer in range(2):
            outs = []
            for attention in (compiled, plain):
                attention.plan(batch)
                outs.append(attention.forward(layer, q, k, v).float())
            paged = [g for g in compiled._groups if g.paged is not None]
            assert len(paged) == 1 and paged[0].num_seqs == sum(n <= 17 for _, n in shapes)
            assert (len(paged[0].paged) == 4) == any(1 < n <= 17 for _, n in shapes)  # q_indptr
            assert torch.allclose(*outs, atol=TOLERANCE[dtype], rtol=0), layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_shared_groups_take_the_cascade_with_the_kernel_on_own_parts(
        variants, monkeypatch, dtype) -> None:
    """Decodes in two groups sharing 48- and 24-token heads (plus a loner): above the saved-keys
    threshold the step takes the cascade, whose own parts the kernel attends from each
    sequence's shared length on; below it, the kernel alone. Both agree with the naive
    per-slot reference, as gather + SDPA does."""
    from engine.contracts.step import BatchInput
    from engine.worker.attention import torch_native

    page_size = 4
    pool = make_pool(page_size, dtype=dtype)
    heads = [list(range(0, 12)), list(range(12, 18))]
    seqs, free = [], iter(range(40, pool.num_pages))
    for g, members in enumerate((5, 3)):
        for m in range(members):
            own = [next(free) for _ in range(1 + (m + g) % 3)]
            cached = len(heads[g]) * page_size + len(own) * page_size - 1 - m % 2
            seqs.append((heads[g] + own, cached, [7]))
    seqs.append(([next(free) for _ in range(5)], 17, [3]))
    batch = BatchInput.build(seqs, page_size)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(batch.num_tokens, 8, 16, generator=gen).to(dtype)
    k = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(dtype)
    v = torch.randn(batch.num_tokens, 2, 16, generator=gen).to(dtype)

    def run(attention, windows=(None, None)):
        attention.sliding_windows = windows
        attention.plan(batch)
        return attention.forward(0, q, k, v).float(), attention._groups[0]

    sdpa, _ = run(backend(pool, False))  # also writes this step's K and V into the pool
    want = reference_attention(pool, 0, batch, q).float()
    assert torch.allclose(sdpa, want, atol=TOLERANCE[dtype], rtol=0)
    for threshold, cascade in ((0, True), (10**9, False)):
        monkeypatch.setattr(torch_native, "CASCADE_MIN_SAVED_KEYS", threshold)
        got, group = run(backend(pool, True))
        assert (group.cascade is not None) == cascade and group.paged is not None
        if cascade:
            assert group.cascade.own_paged is not None and group.cascade.num_groups == 2
            # saved: 4 more members read 48 shared tokens once, 2 more read 24
            assert group.cascade.saved_keys == 4 * 48 + 2 * 24
        assert torch.allclose(got, want, atol=TOLERANCE[dtype], rtol=0), threshold


def test_verify_groups_sharing_enough_take_the_extend_paths_cascade(variants, monkeypatch) -> None:
    """The kernel's cascade attends one query row a sequence: verify-shaped steps whose
    shared pages pay for a cascade take the extend path's (gather + SDPA, shared pages once);
    below the threshold the kernel serves them. Both agree with the reference."""
    from engine.contracts.step import BatchInput
    from engine.worker.attention import torch_native

    page_size = 4
    pool = make_pool(page_size)
    head, free = list(range(0, 12)), iter(range(40, pool.num_pages))
    seqs = [(head + [next(free) for _ in range(3)], 48 + m, [7, 8, 9][: 1 + m % 3])
            for m in range(5)]
    batch = BatchInput.build(seqs, page_size, "all")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch.num_tokens, n, 16, generator=gen) for n in (8, 2, 2))
    attention = backend(pool, False)
    attention.sliding_windows = (None, None)
    attention.plan(batch)
    attention.forward(0, q, k, v)  # this step's K and V into the pool
    want = reference_attention(pool, 0, batch, q)
    for threshold, cascade in ((0, True), (10**9, False)):
        monkeypatch.setattr(torch_native, "CASCADE_MIN_SAVED_KEYS", threshold)
        attention = backend(pool, True)
        attention.sliding_windows = (None, None)
        attention.plan(batch)
        (group,) = attention._groups
        assert (group.paged is None) == cascade and (group.cascade is not None) == cascade
        torch.testing.assert_close(attention.forward(0, q, k, v), want, atol=2e-5, rtol=0)


def test_switch_and_failed_build_leave_the_torch_path(monkeypatch, caplog) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="radixserve.attention"):
        assert cpu_kernels._ops.__wrapped__() is None
    assert f"{ENV_SWITCH}=0" in caplog.text

    monkeypatch.delenv(ENV_SWITCH)

    def no_compiler(variant: str = "native"):
        raise RuntimeError("compiling the CPU kernels failed:\nc++: not found")

    monkeypatch.setattr(cpu_kernels, "build", no_compiler)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.attention"):
        assert cpu_kernels._ops.__wrapped__() is None
    assert "c++: not found" in caplog.text and "SDPA" in caplog.text


def test_decode_kernel_serves_only_where_it_is_vectorised(variants, monkeypatch) -> None:
    """The plain C++ build's decode kernel is no faster than gather + SDPA, so the engine
    takes it only from a build with AVX-512 or AVX2 loops (RMSNorm and rope_store, faster in
    every build, serve either way)."""
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert not variants["portable"].paged_decode_vectorized()
    assert variants["avx2"].paged_decode_vectorized() == avx2
    native = variants["native"].paged_decode_vectorized()
    assert native == ("avx512f" in flags or avx2)
    assert (paged_decode_op() is not None) == native
    monkeypatch.setattr(cpu_kernels, "_ops", lambda: variants["avx2"])
    assert (cpu_kernels.paged_decode_op.__wrapped__() is not None) == avx2
    monkeypatch.setattr(cpu_kernels, "_ops", lambda: variants["portable"])
    assert cpu_kernels.paged_decode_op.__wrapped__() is None
    assert cpu_kernels.rms_norm_op() is variants["portable"].rms_norm
