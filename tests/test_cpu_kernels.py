"""The compiled CPU kernels (engine/worker/csrc/) against float64 references, in this CPU's build,
the AVX2 build that CPUs without AVX-512 take and the portable build that CPUs with neither
take; and the engine's use of them."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.worker import cpu_kernels, lora_pool
from engine.worker.attention import TorchNativeBackend
from engine.worker.cpu_kernels import ENV_SWITCH, paged_decode_op
from engine.worker.kv_pool import KVPool
from engine.worker.lora_pool import LoraPool
from engine.worker.model.lora import LoraWeights, projection_shapes
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


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, back to the weight's dtype, scale."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(weight.dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.float16),
])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (37, 576), (300, 100)])
def test_rms_norm_matches_transformers_arithmetic(variants, variant, x_dtype, w_dtype, rows,
                                                   hidden) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden + 7, generator=gen) * 3)[:, :hidden].to(x_dtype)  # strided
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(w_dtype)
    got = variants[variant].rms_norm(x, weight, 1e-6)
    want = torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == w_dtype and got.shape == (rows, hidden)
    if w_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        # Sums taken in another order may round a normalised value to the neighbouring
        # bf16/fp16 number: at most one unit in the last place, on few elements.
        ulp = 2.0**-7 if w_dtype == torch.bfloat16 else 2.0**-10
        diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert diff.max() <= 2 * ulp and (diff > 0).float().mean() < 0.01


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_rms_norm_takes_the_op_on_cpu_rows_and_torch_elsewhere(variants, monkeypatch,
                                                                      dtype) -> None:
    """The model's ``rms_norm`` on 2-D rows calls the compiled op; with it unavailable (or on
    3-D per-head inputs) the torch formulation gives the same values."""
    from engine.worker.model import llama

    calls = []
    op = cpu_kernels.rms_norm_op()
    monkeypatch.setattr(llama, "rms_norm_op", lambda: lambda *a: calls.append(1) or op(*a))
    x = torch.randn(5, 64, dtype=torch.float32)
    weight = (1 + torch.randn(64) / 4).to(dtype)
    fused = llama.rms_norm(x, weight, 1e-5)
    llama.rms_norm(x.view(5, 4, 16).to(dtype), weight[:16], 1e-5)  # per head: torch
    assert len(calls) == 1
    monkeypatch.setattr(llama, "rms_norm_op", lambda: None)
    plain = llama.rms_norm(x, weight, 1e-5)
    assert plain.dtype == fused.dtype == dtype
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2 ** -7, atol=1e-6)


def rope_case(tokens: int, dtype: torch.dtype, heads: int = 8, kv_heads: int = 4,
              head_dim: int = 64):
    """A step's fused qkv rows (q and k strided views, as the model splits them) and its
    cos / signed sin, as the model's RotaryEmbedding gives them."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(head_dim // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(dtype)
    return qk, v, cos, signed_sin


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope_store_is_apply_rope_and_the_pool_write(variants, variant, dtype, tokens) -> None:
    from engine.worker.attention.base import apply_rope

    qk, v, cos, signed_sin = rope_case(tokens, dtype)
    want_q, want_k = apply_rope(qk, cos, signed_sin).split([8, 4], dim=1)
    k_slots = torch.zeros(1000, 4, 64, dtype=dtype)
    v_slots = torch.zeros(1000, 4, 64, dtype=dtype)
    slots = torch.randperm(1000)[:tokens]
    q = variants[variant].rope_store(qk[:, :8], qk[:, 8:], v, cos, signed_sin, slots, k_slots,
                                     v_slots)
    assert q.is_contiguous() and q.shape == want_q.shape and q.dtype == dtype
    # The same roundings as torch's ops (bit-identical on this CPU; at most one unit in the
    # last place where torch's elementwise kernels round otherwise).
    tight = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(q, want_q, rtol=tight, atol=tight)
    torch.testing.assert_close(k_slots[slots], want_k, rtol=tight, atol=tight)
    assert torch.equal(v_slots[slots], v)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def test_rope_store_refuses_slots_outside_the_pool(variants) -> None:
    qk, v, cos, signed_sin = rope_case(3, torch.float32)
    k_slots = torch.zeros(10, 4, 64)
    with pytest.raises(RuntimeError, match="slot 10 is outside the pool of 10"):
        variants["native"].rope_store(qk[:, :8], qk[:, 8:], v, cos, signed_sin,
                                      torch.tensor([0, 10, 2]), k_slots, k_slots.clone())
    with pytest.raises(RuntimeError, match="model's dtype"):
        variants["native"].rope_store(qk[:, :8], qk[:, 8:], v, cos.bfloat16(), signed_sin,
                                      torch.tensor([0, 1, 2]), k_slots, k_slots.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_rotating_forward_is_apply_rope_then_forward(variants, dtype) -> None:
    """The model's two ways into a layer's attention agree: q and k rotated by the model then
    ``forward``, or rotated and stored by the backend in ``forward_rotating``."""
    from engine.worker.attention.base import apply_rope

    outs, pools = [], []
    pool = make_pool(16, dtype=dtype)
    before = pool.kv.clone()
    for rotating in (True, False):
        pool.kv.copy_(before)
        attention = backend(pool, True)
        assert attention._rope_store is not None
        batch = random_batch(16, pool.num_pages, [(30, 1), (0, 7), (47, 1), (5, 3)])
        qkv = torch.randn(batch.num_tokens, 12, 16, generator=torch.Generator().manual_seed(3))
        qk, v = qkv[:, :10].to(dtype), qkv[:, 10:].to(dtype)
        angles = torch.arange(batch.num_tokens).float()[:, None] * 0.1 * torch.arange(8)
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(dtype)
        signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(dtype)
        attention.plan(batch)
        if rotating:
            outs.append(attention.forward_rotating(0, qk, v, cos, signed_sin))
        else:
            q, k = apply_rope(qk, cos, signed_sin).split([8, 2], dim=1)
            outs.append(attention.forward(0, q, k, v))
        pools.append(pool.kv.clone())
    assert not torch.equal(pools[0], before)  # this step's K and V went in
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[0], pools[1], rtol=1e-5, atol=1e-5)


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


def lora_case(x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    """Odd sizes (37 inputs, 301 outputs: a whole tile and a part), five slots of 24 rows in
    use to 24, 0, 7, 16 and 24, and 15 rows mixing them with rows of the base model (-1): six
    of slot 2, more than one block of rows sharing its weights. Slot 4's B is block-diagonal as
    a fused projection's: rows 0-11 reach outputs 0-149, rows 12-22 the others, row 23 none."""
    gen = torch.Generator().manual_seed(seed)
    a_slots = torch.randn(5, 24, 37, generator=gen).to(w_dtype)
    b_slots = torch.randn(5, 24, 301, generator=gen).to(w_dtype)
    widths = torch.tensor([24, 0, 7, 16, 24])
    spans = torch.tensor([0, 301]).repeat(5, 24, 1)
    b_slots[4, :12, 150:] = 0
    b_slots[4, 12:, :150] = 0
    b_slots[4, 23] = 0
    spans[4, :12] = torch.tensor([0, 150])
    spans[4, 12:] = torch.tensor([150, 301])
    spans[4, 23] = 0
    row_slots = torch.tensor([2, -1, 0, 3, 2, 1, 4, -1, 0, 2, 3, 2, 2, 2, 0])
    x = torch.randn(15, 37, generator=gen).to(x_dtype)
    out = torch.randn(15, 301, generator=gen).to(x_dtype)
    return x, a_slots, b_slots, row_slots, widths, spans, out


def lora_reference(x, a_slots, b_slots, row_slots, widths, out) -> torch.Tensor:
    """out + B[s] (A[s] x) per row (B held transposed), in float64, over each slot's rows in
    use, every column of B read."""
    want = out.double()
    for i, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            width = int(widths[slot])
            a, b = a_slots[slot, :width].double(), b_slots[slot, :width].double()
            want[i] += b.t() @ (a @ x[i].double())
    return want


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_lora_bgmv_matches_float64_reference(variants, variant, x_dtype, w_dtype) -> None:
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(x_dtype, w_dtype)
    got = out.clone()
    variants[variant].lora_bgmv(x, a_slots, b_slots, row_slots, widths, spans, got)
    want = lora_reference(x, a_slots, b_slots, row_slots, widths, out)
    # float32 sums, then one rounding to out's dtype
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x_dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5 * want.abs().max().item())
    untouched = (row_slots < 0) | (widths[row_slots.clamp_min(0)] == 0)
    assert torch.equal(got[untouched], out[untouched])  # base-model rows and empty slots


def test_lora_bgmv_builds_agree_and_rows_do_not_depend_on_their_neighbours(variants) -> None:
    """A row's sums run in one order whether it shares its slot's weight loads with three
    other rows or not."""
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(torch.float32, torch.bfloat16)
    together = out.clone()
    variants["native"].lora_bgmv(x, a_slots, b_slots, row_slots, widths, spans, together)
    for i in range(len(x)):
        alone = out[i : i + 1].clone()
        variants["native"].lora_bgmv(x[i : i + 1], a_slots, b_slots, row_slots[i : i + 1],
                                     widths, spans, alone)
        assert torch.equal(alone[0], together[i])


def test_lora_bgmv_refuses_what_it_cannot_read(variants) -> None:
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(torch.float32, torch.float32)
    op = variants["native"].lora_bgmv
    with pytest.raises(RuntimeError, match="row 2 names slot 5 of 5"):
        op(x, a_slots, b_slots, torch.where(row_slots == 0, 5, row_slots), widths, spans, out)
    with pytest.raises(RuntimeError, match="slot 0 has width 25 of at most 24"):
        op(x, a_slots, b_slots, row_slots, widths + 1, spans, out)
    with pytest.raises(RuntimeError, match=r"b_slots \[L, R, out\]"):
        op(x, a_slots, b_slots.transpose(1, 2).contiguous(), row_slots, widths, spans,
           out[:, :24])
    with pytest.raises(RuntimeError, match="out .* of x's dtype"):
        op(x, a_slots, b_slots, row_slots, widths, spans, out.bfloat16())
    with pytest.raises(RuntimeError, match="row_slots int64"):
        op(x, a_slots, b_slots, row_slots.int(), widths, spans, out)
    with pytest.raises(RuntimeError, match=r"spans int64 \[L, R, 2\]"):
        op(x, a_slots, b_slots, row_slots, widths, spans[:, :, 0], out)


def random_adapter(config, rank: int, seed: int) -> LoraWeights:
    """Every projection of every layer adapted, its parts' A stacked and B block-diagonal
    (held transposed, as load_adapter holds it)."""
    gen = torch.Generator().manual_seed(seed)
    mats = {}
    for layer in range(config.num_layers):
        for name, (width, outs) in projection_shapes(config).items():
            a = torch.randn(len(outs) * rank, width, generator=gen)
            b = torch.block_diag(*[torch.randn(part, rank, generator=gen) for part in outs])
            mats[(layer, name)] = (a, b.t().contiguous())
    return LoraWeights(f"random{seed}", rank, str(seed), mats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_step_takes_the_op_on_cpu_and_the_segmented_form_without(variants, monkeypatch,
                                                                      dtype) -> None:
    """The same updates through the op (slots in the model's dtype, bf16 or float32) and through
    torch's segmented form (float32 slots), for a prefill chunk past the first rows."""
    config = SimpleNamespace(num_layers=2, hidden_size=40, intermediate_size=72, num_heads=4,
                             num_kv_heads=2, head_dim=10)
    pools = [LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=dtype)]
    monkeypatch.setattr(lora_pool, "lora_bgmv_op", lambda: None)
    pools.append(LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"),
                          dtype=dtype))
    assert pools[0].kernel is not None and pools[1].kernel is None
    assert pools[0].dtype == dtype and pools[1].dtype == torch.float32
    # adapters 1 and 2 of ranks 8 and 3, sequences under 1, none, 2 and 1
    lora_ids, extend_lens = np.array([1, 0, 2, 1]), np.array([5, 2, 3, 1])
    for pool in pools:
        for lora_id, rank in ((1, 8), (2, 3)):
            pool.add(lora_id, random_adapter(config, rank, lora_id))
    steps = [pool.prepare(lora_ids, extend_lens) for pool in pools]
    # q, k and v take outputs 0-39, 40-59 and 60-79; adapter 1's rank rows 0-7, 8-15 and 16-23
    spans = pools[0].spans[(1, "qkv")][pools[0].resident[1], :24]
    assert spans.unique_consecutive(dim=0).tolist() == [[0, 40], [40, 60], [60, 80]]
    gen = torch.Generator().manual_seed(0)
    for name, (width, outs) in projection_shapes(config).items():
        x = torch.randn(7, width, generator=gen).to(dtype)
        out = torch.randn(7, sum(outs), generator=gen).to(dtype)
        got = [out.clone() for _ in steps]
        for step, result in zip(steps, got, strict=True):
            step.add_(1, name, x, result, start=4)
        # rows 0 and 6: adapter 1; 1 and 2: the base model; 3 to 5: adapter 2
        scale = (got[1] - out).abs().max().item()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=tolerance * scale)
        assert torch.equal(got[0][1:3], out[1:3])
        assert not torch.equal(got[0][0], out[0]) and not torch.equal(got[0][6], out[6])
