"""The compiled CPU decode kernel (engine/attention/csrc/paged_decode.cpp) against a float64
reference, in the build every CPU with AVX-512 takes and in the portable build other CPUs take;
and the torch backend's use of it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.attention import TorchNativeBackend, cpu_kernels
from engine.attention.cpu_kernels import ENV_SWITCH, paged_decode_op
from engine.kv_pool import KVPool
from tests.test_attention import make_pool, random_batch


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    op = paged_decode_op()
    assert op is not None, "the compiled kernel did not build here (see the log)"
    torch.ops.load_library(str(cpu_kernels.build(portable=True)))
    return {"native": op, "portable": torch.ops.radixserve_portable.paged_decode}


def reference(q, k_pages, v_pages, indptr, indices, seq_lens, window, scale) -> torch.Tensor:
    """Dense float64 softmax attention of each sequence's one query over its keys."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k_pages.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(num_seqs):
        pages = indices[indptr[b]: indptr[b + 1]].long()
        length = int(seq_lens[b])
        first = max(0, length - window) if window else 0
        k = k_pages[pages].reshape(-1, num_kv, head_dim)[first:length].double()
        v = v_pages[pages].reshape(-1, num_kv, head_dim)[first:length].double()
        k = k.repeat_interleave(num_heads // num_kv, dim=1)
        v = v.repeat_interleave(num_heads // num_kv, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        out[b] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


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


@pytest.mark.parametrize("variant", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(8, 4, 32), (9, 3, 64), (4, 4, 16), (32, 8, 128), (6, 2, 40), (8, 1, 64)],
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [0, 5, 40])
def test_kernel_matches_float64_reference(variants, variant, dtype, heads, kv_heads, head_dim,
                                          page_size, window) -> None:
    # Lengths on and around page and 16-key block edges, and a long one.
    seq_lens = [1, 15, 16, 17, 33, 200]
    case = random_case(heads, kv_heads, head_dim, page_size, seq_lens, dtype)
    scale = head_dim**-0.5
    want = reference(*case, window, scale)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):  # one item per sequence, or sequences split by KV heads
            torch.set_num_threads(threads)
            got = variants[variant](*case, window, scale)
            assert got.dtype == dtype and got.shape == case[0].shape
            err = (got.double() - want).abs().max().item()
            assert err < TOLERANCE[dtype], (threads, err)
    finally:
        torch.set_num_threads(before)


def test_kernel_refuses_what_it_cannot_read(variants) -> None:
    q, k, v, indptr, indices, seq_lens = random_case(8, 4, 32, 16, [20, 3], torch.float32)
    op = variants["native"]
    with pytest.raises(RuntimeError, match="int32 indptr"):
        op(q, k, v, indptr.long(), indices, seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(q.bfloat16(), k, v, indptr, indices, seq_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="head sizes disagree"):
        op(q[:, :6].contiguous(), k, v, indptr, indices, seq_lens, 0, 1.0)


def backend(pool: KVPool, compiled: bool) -> TorchNativeBackend:
    return TorchNativeBackend(pool, num_heads=8, num_kv_heads=2, head_dim=16,
                              sliding_windows=(None, 5), compiled=compiled)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decodes_through_the_kernel_as_the_sdpa_path_does(variants, page_size,
                                                                  dtype) -> None:
    """A mixed step (decodes among extends, so the decode group is a subset of the rows) and a
    decode-only step: the kernel and gather + SDPA agree, on both layers (one windowed)."""
    for shapes in ([(30, 1), (0, 7), (47, 1), (5, 3), (16, 1)], [(30, 1), (47, 1), (0, 1)]):
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
            assert any(g.paged is not None for g in compiled._groups)
            assert torch.allclose(*outs, atol=TOLERANCE[dtype], rtol=0), layer


def test_switch_and_failed_build_leave_the_torch_path(monkeypatch, caplog) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="radixserve.attention"):
        assert paged_decode_op.__wrapped__() is None
    assert f"{ENV_SWITCH}=0" in caplog.text

    monkeypatch.delenv(ENV_SWITCH)

    def no_compiler(portable: bool = False):
        raise RuntimeError("compiling the CPU kernels failed:\nc++: not found")

    monkeypatch.setattr(cpu_kernels, "build", no_compiler)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.attention"):
        assert paged_decode_op.__wrapped__() is None
    assert "c++: not found" in caplog.text and "SDPA" in caplog.text
