"""Shared-prefix (cascade) decode attention equals plain attention over each sequence's pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.worker.attention.cascade import attend_cascade, plan_cascade


def reference(q, k_pages, v_pages, tables, seq_lens, scale):
    out = []
    for i, (pages, n) in enumerate(zip(tables, seq_lens, strict=True)):
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n]  # [n, kv, D]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


# Low precision: the partial results and their log-sum-exps merge in float32 and the output
# comes back in the activation dtype; bf16 (8 significant bits) rounds q, K, V and the output.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3,
              torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cascade_equals_plain_attention(page_size, dtype):
    rng = np.random.default_rng(page_size)
    num_pages, kv, heads, dim = 600, 2, 4, 8
    k_pages = torch.randn(num_pages, page_size, kv, dim, dtype=torch.float64)
    v_pages = torch.randn(num_pages, page_size, kv, dim, dtype=torch.float64)
    free = iter(rng.permutation(num_pages).tolist())
    tables, seq_lens = [], []
    for group_size, shared in [(3, 6), (2, 9), (1, 0), (4, 5)]:
        prefix = [next(free) for _ in range(shared)]
        for _ in range(group_size):
            own = int(rng.integers(1, 4))
            tables.append(prefix + [next(free) for _ in range(own)])
            seq_lens.append((shared + own - 1) * page_size + int(rng.integers(1, page_size + 1)))
    counts = np.array([len(t) for t in tables])
    table = np.zeros((len(tables), counts.max()), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    seq_lens = np.array(seq_lens)
    plan = plan_cascade(table, counts, seq_lens, (seq_lens - 1)[:, None], page_size,
                        torch.device("cpu"), dtype)
    assert plan is not None and plan.num_groups == 3  # the single sequence shares nothing
    # groups sharing different runs: the shorter ones' padding is masked; members are selected
    assert plan.shared_mask is not None and not plan.whole
    q = torch.randn(len(tables), 1, heads, dim, dtype=torch.float64)
    got = attend_cascade(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), plan, dim**-0.5)
    assert got.dtype == dtype
    want = reference(q[:, 0], k_pages, v_pages, tables, seq_lens, dim**-0.5)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got[:, 0].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_cascade_extend_is_causal_within_own_pages(dtype):
    """Several query rows per sequence (a prefill chunk over a shared cached prefix); one
    group of every sequence sharing all its pages: unmasked, no rows selected or scattered."""
    page_size, kv, heads, dim, extend = 4, 2, 4, 8, 5
    k_pages = torch.randn(64, page_size, kv, dim, dtype=torch.float64)
    v_pages = torch.randn(64, page_size, kv, dim, dtype=torch.float64)
    prefix = list(range(10, 20))  # 10 shared pages = 40 cached tokens
    tables = [prefix + [30, 31], prefix + [40, 41]]
    seq_lens = np.array([40 + extend, 40 + extend - 2])  # the second extends by 3 (padded)
    query_pos = np.array([[40 + i for i in range(extend)],
                          [40, 41, 42, 42, 42]])
    counts = np.array([12, 12])
    table = np.array(tables)
    plan = plan_cascade(table, counts, seq_lens, query_pos, page_size, torch.device("cpu"),
                        dtype)
    assert plan is not None and plan.whole and plan.shared_mask is None
    q = torch.randn(2, extend, heads, dim, dtype=torch.float64)
    got = attend_cascade(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), plan, dim**-0.5)
    assert got.dtype == dtype
    tol = TOLERANCES[dtype] if dtype != torch.float64 else 1e-10
    for b in range(2):
        for row in range(extend):
            pos = int(query_pos[b, row])
            want = reference(q[b : b + 1, row], k_pages, v_pages, [tables[b]], [pos + 1],
                             dim**-0.5)
            torch.testing.assert_close(got[b, row].double(), want[0], rtol=tol, atol=tol)


def test_no_plan_without_enough_sharing():
    table = np.array([[1, 2, 3, 4, 5, 6], [1, 2, 9, 10, 11, 12]])
    counts = np.array([6, 6])
    assert plan_cascade(table, counts, np.array([90, 90]), np.array([[89], [89]]), 16,
                        torch.device("cpu"), torch.float32) is None


def test_fused_cpu_partial_equals_math():
    from engine.worker.attention.cascade import partial_flash_cpu, partial_math

    q, k, v = (torch.randn(3, 2, 7, 8) for _ in range(3))
    mask = torch.zeros(3, 1, 1, 7)
    mask[:, :, :, 5:] = float("-inf")
    out_a, lse_a = partial_flash_cpu(q, k, v, mask, 0.3)
    out_b, lse_b = partial_math(q, k, v, mask, 0.3)
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, rtol=1e-5, atol=1e-5)


def test_math_partials_in_bf16_are_as_accurate_as_plain_attention():
    """The GPU path of the torch backend (``partial_math``) over bf16 activations: splitting the
    keys in two and merging by log-sum-exp must not cost accuracy over one plain bf16 attention
    (scores and log-sum-exp kept in bf16 made it 3.6x worse here; now 1.04x)."""
    from engine.worker.attention.cascade import merge_partials, partial_math

    torch.manual_seed(0)
    heads, rows, keys, dim, split = 8, 4, 600, 64, 512
    q, k, v = (torch.randn(2, heads, n, dim, dtype=torch.float64) * 2
               for n in (rows, keys, keys))
    scale = dim**-0.5
    want = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    plain = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, scale=scale)
    no_mask = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)
    out_a, lse_a = partial_math(qb, kb[:, :, :split], vb[:, :, :split], no_mask, scale)
    out_b, lse_b = partial_math(qb, kb[:, :, split:], vb[:, :, split:], no_mask, scale)
    merged = merge_partials(out_a, lse_a, out_b, lse_b)
    assert merged.dtype == torch.bfloat16
    plain_err = (plain.double() - want).abs().mean()
    merged_err = (merged.double() - want).abs().mean()
    assert merged_err <= 1.5 * plain_err, (float(merged_err), float(plain_err))


def test_pages_the_step_writes_are_never_shared():
    """Two sequences extending over pages they share (a draft model catching up two forks on
    a prompt it lacks from position 20): the shared run stops before the first query row's
    page, else those rows would see the later positions of the pages they write."""
    page_size, start, end = 4, 20, 37
    table = np.array([[0, 1, 2, 3, 4, 44, 45, 46, 41, 38],
                      [0, 1, 2, 3, 4, 44, 45, 46, 37, 35]], dtype=np.int64)
    counts, seq_lens = np.array([10, 10]), np.array([end, end])
    query_pos = np.tile(np.arange(start, end), (2, 1))
    plan = plan_cascade(table, counts, seq_lens, query_pos, page_size, torch.device("cpu"),
                        torch.float32)
    assert plan is None or (plan.shared_tokens <= start).all()
