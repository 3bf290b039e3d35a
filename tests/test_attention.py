"""Attention backends against a naive per-sequence reference over the same paged pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.step import BatchInput
from engine.worker.attention import make_backend, resolve_backend
from engine.worker.kv_pool import KVPool
from tests.conftest_models import one_torch_thread

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 2, 16, 2
WINDOWS = (None, 5)  # layer 1 attends to the last 5 positions only


def make_pool(page_size: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
              head_dim: int = HEAD_DIM) -> KVPool:
    pool = KVPool(
        num_layers=LAYERS,
        num_pages=512 // page_size,
        page_size=page_size,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
    )
    pool.kv.normal_()  # stands in for KV written by earlier steps
    return pool


def random_batch(page_size: int, num_pages: int, shapes: list[tuple[int, int]], seed: int = 0):
    """A batch of (cached_len, extend_len) sequences on shuffled, disjoint pages."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(num_pages))
    seqs = []
    for cached, new in shapes:
        count = -(-(cached + new) // page_size)
        pages, free = free[:count], free[count:]
        seqs.append((pages, cached, rng.integers(0, 100, new)))
    return BatchInput.build(seqs, page_size, "all")


def reference_attention(
    pool: KVPool, layer: int, batch: BatchInput, q: torch.Tensor
) -> torch.Tensor:
    """Dense softmax attention, one sequence at a time, K/V read slot by slot."""
    page_size, window = pool.page_size, WINDOWS[layer]
    k_pages, v_pages = (t.reshape(-1, KV_HEADS, HEAD_DIM).float() for t in pool.layer(layer))
    out, row = [], 0
    for b in range(batch.num_seqs):
        pages = batch.page_indices[batch.page_indptr[b] : batch.page_indptr[b + 1]]
        seq_len, extend = int(batch.seq_lens[b]), int(batch.extend_lens[b])
        slots = torch.tensor(
            [pages[i // page_size] * page_size + i % page_size for i in range(seq_len)]
        )
        k = k_pages[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [S, H, D]
        v = v_pages[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
        qb = q[row : row + extend].float()
        scores = torch.einsum("thd,shd->hts", qb, k) * HEAD_DIM**-0.5
        q_pos = torch.arange(seq_len - extend, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v))
        row += extend
    return torch.cat(out)


def run_backend(name: str, pool: KVPool, batch: BatchInput, seed: int = 0) -> list[torch.Tensor]:
    head_dim = pool.kv.shape[-1]
    backend = make_backend(
        name,
        pool,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        sliding_windows=WINDOWS,
    )
    backend.plan(batch)
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for layer in range(LAYERS):
        q, k, v = (
            torch.randn(batch.num_tokens, h, head_dim, generator=gen).to(pool.kv)
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )
        outs.append((q, k, v, backend.forward(layer, q, k, v)))
    return outs


SHAPES = {
    "prefill": [(0, 23)],
    "fresh prefills, padded": [(0, 23), (0, 5), (0, 17)],
    "decode": [(30, 1), (0, 1), (16, 1), (47, 1)],
    "mixed": [(9, 7), (12, 1), (0, 20), (33, 1), (15, 2)],
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_backend_matches_reference(page_size: int, shape: str) -> None:
    pool = make_pool(page_size)
    batch = random_batch(page_size, pool.num_pages, SHAPES[shape])
    for layer, (q, k, v, out) in enumerate(run_backend("torch", pool, batch)):
        slots = torch.from_numpy(batch.out_slots.astype(np.int64))
        k_slots, v_slots = (t.reshape(-1, KV_HEADS, HEAD_DIM) for t in pool.layer(layer))
        assert torch.equal(k_slots[slots], k) and torch.equal(v_slots[slots], v)
        torch.testing.assert_close(
            out, reference_attention(pool, layer, batch, q), atol=1e-5, rtol=0
        )


def test_auto_picks_torch_without_cuda_and_flashinfer_explains_itself() -> None:
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("triton", torch.device("cpu"), torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"pip install 'radixserve\[gpu\]'"):
            run_backend("flashinfer", make_pool(16, head_dim=64), random_batch(16, 32, [(0, 3)]))


def test_auto_takes_flashinfer_only_for_its_head_dims(monkeypatch) -> None:
    import engine.worker.attention as attention

    monkeypatch.setattr(attention, "flashinfer_installed", lambda: True)
    cuda = torch.device("cuda")
    assert [resolve_backend("auto", cuda, torch.bfloat16, d) for d in (32, 64, 96, 128, 256)] == [
        "torch", "flashinfer", "torch", "flashinfer", "flashinfer"]
    assert resolve_backend("auto", cuda, torch.float32, 128) == "torch"
    monkeypatch.setattr(attention, "flashinfer_installed", lambda: False)
    assert resolve_backend("auto", cuda, torch.bfloat16, 128) == "torch"


def test_flashinfer_refuses_other_head_dims_by_name() -> None:
    with pytest.raises(ValueError, match="head_dim 64, 128, 256; this model's is 16"):
        run_backend("flashinfer", make_pool(16), random_batch(16, 32, [(0, 3)]))


def test_auto_falls_back_to_torch_when_flashinfer_fails_to_start(monkeypatch, caplog) -> None:
    """A broken install or a kernel that does not compile shows at construction or warm-up:
    under auto the torch backend serves instead, and the log says why."""
    import engine.worker.attention as attention

    class Broken:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def warm_up(self) -> None:
            raise RuntimeError("ninja: build stopped: subcommand failed")

    monkeypatch.setattr(attention, "resolve_backend", lambda *args: "flashinfer")
    monkeypatch.setattr(attention, "FlashInferBackend", Broken)
    pool = make_pool(16)
    with caplog.at_level("WARNING", logger="radixserve.attention"):
        backend = make_backend("auto", pool, num_heads=HEADS, num_kv_heads=KV_HEADS,
                               head_dim=HEAD_DIM, sliding_windows=WINDOWS)
    assert backend.name == "torch"
    assert "flashinfer failed to start (RuntimeError: ninja: build stopped" in caplog.text
    with pytest.raises(RuntimeError, match="ninja"):
        make_backend("flashinfer", pool, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     head_dim=HEAD_DIM, sliding_windows=WINDOWS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flashinfer_matches_torch_on_cuda(page_size: int, shape: str) -> None:
    results = {}
    for name in ("torch", "flashinfer"):
        torch.manual_seed(0)
        # 128: FlashInfer builds its prefill kernels for head_dim 64, 128 and 256 only.
        pool = make_pool(page_size, "cuda", torch.bfloat16, head_dim=128)
        batch = random_batch(page_size, pool.num_pages, SHAPES[shape])
        results[name] = [out.float() for *_, out in run_backend(name, pool, batch)]
    for expected, got in zip(results["torch"], results["flashinfer"], strict=True):
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)
