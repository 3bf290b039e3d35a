"""int8 KV (engine/worker/kv_quant.py): the format against a float64 reference, the pool carrying
scales through every move of a page (copy-on-write, fork, swap, tensor-parallel shards), the
capacity --kv-cache-gb buys, and the start-up refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.worker import kv_quant
from engine.worker.kv_pool import KVPool
from engine.worker.kv_quant import dequantize, quantize, resolve_kv_dtype, scales
from engine.worker.runner import ModelRunner
from tests.conftest_models import write_checkpoint


def reference_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64: scale = the float16 nearest max |x| / 127; values round(x / scale) in +-127."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / 127).astype(np.float16).astype(np.float64)
    values = np.where(scale > 0, np.round(x / np.where(scale > 0, scale, 1)), 0)
    return np.clip(values, -127, 127), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_the_float64_reference_and_dequantize_is_exact(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 64, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 30)
    x[0, 0] = 0  # an all-zero row: scale 0, values 0
    x = x.to(dtype)
    rows = quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 3, 66)
    want_values, want_scale = reference_quantize(x.double().numpy())
    got_scale = scales(rows).double().numpy()[..., None]
    np.testing.assert_array_equal(got_scale, want_scale)
    # Values agree but where x / scale sits on a rounding tie in float64 and not in float32.
    differ = rows[..., :64].double().numpy() != want_values
    assert differ.mean() < 1e-3 and np.all(np.abs(rows[..., :64].numpy()[differ]
                                                  - want_values[differ]) == 1)
    back = dequantize(rows, torch.float32).double().numpy()
    np.testing.assert_array_equal(back, rows[..., :64].double().numpy() * want_scale)
    # The quantization error is at most half a step (plus a step where amax / 127 rounded
    # down in float16 and the largest value clipped).
    assert np.all(np.abs(back - x.double().numpy()) <= want_scale * (0.5 + 1 / 127) + 1e-12)
    assert not rows[0, 0].any()


def make_pool(num_host_pages: int = 4) -> KVPool:
    return KVPool(num_layers=3, num_pages=8, page_size=4, num_kv_heads=2, head_dim=6,
                  dtype=torch.float32, device="cpu", num_host_pages=num_host_pages,
                  kv_dtype=torch.int8)


def filled_pool() -> tuple[KVPool, torch.Tensor]:
    """A pool whose every slot holds quantized K and V, with scales that differ per row (a
    lost or stale scale changes the values), and those values dequantized."""
    pool = make_pool()
    gen = torch.Generator().manual_seed(1)
    slots = torch.arange(pool.num_pages * pool.page_size)
    for layer in range(pool.num_layers):
        spread = torch.rand(len(slots), 2, 1, generator=gen) * 10
        k = torch.randn(len(slots), 2, 6, generator=gen) * spread
        v = torch.randn(len(slots), 2, 6, generator=gen) * spread
        pool.write(layer, slots, k, v)
    return pool, dequantize(pool.kv, torch.float32)


def test_write_stores_quantized_rows_with_their_scales() -> None:
    pool = make_pool()
    k, v = torch.randn(3, 2, 6), torch.randn(3, 2, 6) * 5
    pool.write(1, torch.tensor([0, 9, 31]), k, v)
    k_pages, v_pages = pool.layer(1)
    assert k_pages.shape == (8, 4, 2, 8) and k_pages.dtype == torch.int8
    for row, slot in enumerate([0, 9, 31]):
        assert torch.equal(k_pages[slot // 4, slot % 4], quantize(k[row]))
        assert torch.equal(v_pages[slot // 4, slot % 4], quantize(v[row]))
    torch.testing.assert_close(dequantize(v_pages[2, 1], torch.float32), v[1],
                               atol=float(v[1].abs().max()) / 254 + 1e-6, rtol=0)
    assert int((pool.kv != 0).sum()) <= 2 * 3 * 2 * 8


def test_copy_on_write_of_a_partial_page_carries_values_and_scales() -> None:
    pool, before = filled_pool()
    pool.copy_pages(np.array([[2, 5, 3], [6, 0, 4]], dtype=np.int32))
    after = dequantize(pool.kv, torch.float32)
    assert torch.equal(after[:, :, 5, :3], before[:, :, 2, :3])
    assert torch.equal(after[:, :, 5, 3:], before[:, :, 5, 3:])
    assert torch.equal(after[:, :, 0], before[:, :, 6])


def test_a_fork_reads_its_parents_values_after_its_unshare_copy() -> None:
    """A fork shares its parent's pages; the copy its next growth plans (``unshare_at``) gives
    it the parent's partial page, scales included, and the parent's later writes stay its own."""
    pool, before = filled_pool()
    parent_table, shared_partial = [1, 3], 3
    pool.copy_pages(np.array([[shared_partial, 7, 2]], dtype=np.int32))
    child_table = [1, 7]
    after = dequantize(pool.kv, torch.float32)
    for layer in range(3):
        for which in range(2):
            parent = after[layer, which, parent_table].reshape(-1, 2, 6)[:6]
            child = after[layer, which, child_table].reshape(-1, 2, 6)[:6]
            assert torch.equal(parent, child)
    pool.write(0, torch.tensor([3 * 4 + 2]), torch.full((1, 2, 6), 9.0), torch.zeros(1, 2, 6))
    assert torch.equal(dequantize(pool.kv[0, :, 7, :2], torch.float32), before[0, :, 3, :2])


def test_swap_out_and_in_carries_values_and_scales() -> None:
    pool, before = filled_pool()
    pool.swap_out(np.array([[1, 2], [6, 0]], dtype=np.int64))
    pool.kv[:, :, [1, 6]] = 0
    pool.swap_in(np.array([[2, 4], [0, 3]], dtype=np.int64))
    after = dequantize(pool.kv, torch.float32)
    assert torch.equal(after[:, :, 4], before[:, :, 1])
    assert torch.equal(after[:, :, 3], before[:, :, 6])
    assert torch.equal(pool.host[:, :, 2], pool.kv[:, :, 4])


def test_int8_pages_hold_at_least_1_9_times_the_tokens_of_bf16() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; and a model with heads of 128.
    for layers, kv_heads, head_dim in ((30, 3, 64), (32, 8, 128)):
        shape = dict(num_layers=layers, page_size=16, num_kv_heads=kv_heads, head_dim=head_dim)
        bf16 = KVPool.bytes_per_page(**shape, dtype=torch.bfloat16)
        int8 = KVPool.bytes_per_page(**shape, dtype=torch.int8)
        assert bf16 / int8 == 2 * head_dim / (head_dim + 2) >= 1.9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama"))


def test_runner_buys_pages_for_the_kv_dtype_and_logs_it(checkpoint, caplog) -> None:
    pages = {}
    for kv in ("auto", "int8"):
        with caplog.at_level("INFO", logger="engine.worker.runner"):
            runner = ModelRunner(EngineConfig(model=checkpoint, dtype="bfloat16",
                                              kv_cache_dtype=kv, kv_cache_gb=0.01))
        pages[kv] = runner.num_pages
        assert runner.pool.kv.dtype == (torch.int8 if kv == "int8" else torch.bfloat16)
    assert pages["int8"] / pages["auto"] >= 1.75  # head_dim 16: 2 * 16 / 18
    assert "KV cache: int8" in caplog.text and f"= {pages['int8'] * 16} tokens" in caplog.text


def test_combinations_that_cannot_run_are_refused_with_what_to_use() -> None:
    with pytest.raises(ValueError, match="use --dtype bfloat16, or --kv-cache-dtype auto or int8"):
        resolve_kv_dtype("bfloat16", torch.float32)
    assert resolve_kv_dtype("float32", torch.float32) == torch.float32
    assert resolve_kv_dtype("auto", torch.float16) == torch.float16
    assert resolve_kv_dtype("int8", torch.float32) == torch.int8
    from engine.worker.attention import resolve_backend

    with pytest.raises(ValueError, match="--attention-backend torch with --kv-cache-dtype int8"):
        resolve_backend("flashinfer", torch.device("cuda"), torch.bfloat16, 64, torch.int8)
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, 64, torch.int8) == "torch"
    assert kv_quant.row_width(64, torch.int8) == 66


def test_tensor_parallel_ranks_hold_their_heads_values_and_scales(checkpoint) -> None:
    """Each rank's int8 pool holds its KV heads' rows of the unsharded pool, scales included,
    and the sharded forward gives the unsharded one's logits."""
    from tests.test_tp import run_ranks, two_steps

    options = dict(page_size=4, num_pages=16, dtype="float32", attention_backend="torch",
                   kv_cache_dtype="int8")
    steps = two_steps(4, 96)
    whole = ModelRunner(EngineConfig(model=checkpoint, **options))
    expected = [whole.forward(step) for step in steps]

    def rank_work(tp):
        runner = ModelRunner(EngineConfig(model=checkpoint, **options), tp)
        return [runner.forward(step) for step in steps], runner.pool.kv.clone()

    results = run_ranks(2, rank_work)
    for got, want in zip(results[0][0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for rank, (_, kv) in enumerate(results):
        mine = whole.pool.kv[:, :, :, :, rank:rank + 1]
        assert kv.shape == mine.shape
        torch.testing.assert_close(scales(kv), scales(mine), rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(dequantize(kv, torch.float32),
                                   dequantize(mine, torch.float32), rtol=0,
                                   atol=float(scales(mine).max()) * 1.01)
