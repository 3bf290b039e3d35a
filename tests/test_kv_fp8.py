"""fp8 KV (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``, engine/worker/kv_quant.py): the format
against a float64 reference, the pool moving its bytes through copies and swaps, the torch paths
and the FlashInfer contract reading the pages as their fp8 values, and the pages it buys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.attention import TorchNativeBackend, make_backend, resolve_backend, torch_native
from engine.worker.kv_pool import KVPool
from engine.worker.kv_quant import decode, encode, resolve_kv_dtype
from engine.worker.runner import ModelRunner
from tests.conftest_models import one_torch_thread, write_checkpoint
from tests.test_attention import SHAPES, random_batch, reference_attention
from tests.test_flashinfer_contract import fake  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (largest finite value, mantissa bits) of each format
FORMATS = {torch.float8_e4m3fn: (448.0, 3), torch.float8_e5m2: (57344.0, 2)}
HEADS, KV_HEADS = 8, 2


def reference_fp8(x: np.ndarray, kv_dtype: torch.dtype) -> np.ndarray:
    """float64: round to nearest (ties to even) with the format's mantissa bits, saturating at
    its largest value; subnormals below its smallest normal exponent."""
    limit, bits = FORMATS[kv_dtype]
    min_exp = -6 if kv_dtype == torch.float8_e4m3fn else -14
    clipped = np.clip(x, -limit, limit)
    exp = np.maximum(np.floor(np.log2(np.maximum(np.abs(clipped), 1e-300))), min_exp)
    step = 2.0 ** (exp - bits)
    return np.clip(np.round(clipped / step) * step, -limit, limit)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_matches_the_float64_reference_and_saturates(kv_dtype, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.rand(64, 3, 1, generator=gen) * 30
    x[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 5e-3])  # past the range, zero, subnormal
    x = x.to(dtype)
    rows = encode(x, kv_dtype)
    assert rows.dtype == torch.uint8 and rows.shape == x.shape
    back = decode(rows, kv_dtype, torch.float64).numpy()
    np.testing.assert_array_equal(back, reference_fp8(x.double().numpy(), kv_dtype))
    limit, bits = FORMATS[kv_dtype]
    assert back[0, 0, 0] == limit and back[0, 0, 1] == -limit and np.isfinite(back).all()
    wide = x.double().numpy()
    normal = (np.abs(wide) >= 2.0 ** (-6 if bits == 3 else -14)) & (np.abs(wide) <= limit)
    relative = np.abs(back[normal] - wide[normal]) / np.abs(wide[normal])
    assert relative.max() <= 2.0 ** -(bits + 1)


def fp8_pool(kv_dtype: torch.dtype, page_size: int, num_host_pages: int = 0,
             head_dim: int = 16) -> KVPool:
    pool = KVPool(num_layers=2, num_pages=512 // page_size, page_size=page_size,
                  num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=torch.float32, device="cpu",
                  kv_dtype=kv_dtype, num_host_pages=num_host_pages)
    gen = torch.Generator().manual_seed(7)
    pool.kv.copy_(encode(torch.randn(pool.kv.shape, generator=gen) * 3, kv_dtype))
    return pool


def decoded(pool: KVPool) -> KVPool:
    """A float64 pool holding ``pool``'s values, for the reference."""
    twin = KVPool(num_layers=2, num_pages=pool.num_pages, page_size=pool.page_size,
                  num_kv_heads=KV_HEADS, head_dim=pool.head_dim, dtype=torch.float64,
                  device="cpu")
    twin.kv.copy_(decode(pool.kv, pool.kv_dtype, torch.float64))
    return twin


@pytest.mark.parametrize("kv_dtype", FP8)
def test_the_pool_moves_fp8_bytes_through_writes_copies_and_swaps(kv_dtype) -> None:
    pool = fp8_pool(kv_dtype, 4, num_host_pages=4)
    k, v = torch.randn(3, KV_HEADS, 16) * 50, torch.randn(3, KV_HEADS, 16)
    pool.write(1, torch.tensor([0, 9, 31]), k, v)
    k_pages, v_pages = pool.layer(1)
    assert k_pages.dtype == torch.uint8
    for row, slot in enumerate([0, 9, 31]):
        assert torch.equal(k_pages[slot // 4, slot % 4], encode(k[row], kv_dtype))
        assert torch.equal(v_pages[slot // 4, slot % 4], encode(v[row], kv_dtype))
    before = pool.kv.clone()
    pool.copy_pages(np.array([[2, 5, 3]], dtype=np.int32))
    assert torch.equal(pool.kv[:, :, 5, :3], before[:, :, 2, :3])
    assert torch.equal(pool.kv[:, :, 5, 3:], before[:, :, 5, 3:])
    pool.swap_out(np.array([[1, 2]], dtype=np.int64))
    pool.kv[:, :, 1] = 0
    pool.swap_in(np.array([[2, 4]], dtype=np.int64))
    assert torch.equal(pool.kv[:, :, 4], before[:, :, 1])


def step_tensors(num_tokens: int, kv_dtype: torch.dtype, head_dim: int = 16):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(num_tokens, h, head_dim, generator=gen)
            for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_backend_on_fp8_pages_matches_float64_over_their_values(kv_dtype, page_size,
                                                                     shape) -> None:
    """Prefills, extends over cached pages and decodes, a windowed layer among them: this
    step's K and V are stored as fp8 and attention reads every key as its fp8 value."""
    pool = fp8_pool(kv_dtype, page_size)
    batch = random_batch(page_size, pool.num_pages, SHAPES[shape])
    attention = TorchNativeBackend(pool, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=16,
                                   sliding_windows=(None, 5))
    assert attention._paged_decode is None and attention._rope_store is None
    attention.plan(batch)
    slots = torch.from_numpy(batch.out_slots.astype(np.int64))
    for layer in range(2):
        q, k, v = step_tensors(batch.num_tokens, kv_dtype)
        out = attention.forward(layer, q, k, v)
        k_slots, _ = pool.slots(layer)
        assert torch.equal(k_slots[slots], encode(k, kv_dtype))
        want = reference_attention(decoded(pool), layer, batch, q.double())
        torch.testing.assert_close(out.double(), want.double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("decode_step", [True, False])
def test_cascade_over_fp8_shared_prefixes_matches_float64(monkeypatch, decode_step) -> None:
    monkeypatch.setattr(torch_native, "CASCADE_MIN_SAVED_KEYS", 0)
    pool = fp8_pool(torch.float8_e4m3fn, 4)
    heads = [list(range(0, 12)), list(range(12, 18))]
    seqs, free = [], iter(range(40, pool.num_pages))
    new = [7] if decode_step else [7, 8, 9]
    for g, members in enumerate((5, 3)):
        for m in range(members):
            own = [next(free) for _ in range(2 + (m + g) % 3)]
            seqs.append((heads[g] + own, (len(heads[g]) + len(own)) * 4 - 3 - m % 2, new))
    batch = BatchInput.build(seqs, 4)
    attention = TorchNativeBackend(pool, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=16,
                                   sliding_windows=(None, None))
    attention.plan(batch)
    assert attention._groups[0].cascade is not None
    q, k, v = step_tensors(batch.num_tokens, torch.float8_e4m3fn)
    out = attention.forward(0, q, k, v)
    want = reference_attention(decoded(pool), 0, batch, q.double())
    torch.testing.assert_close(out.double(), want.double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_plans_fp8_kv_and_reads_the_pages_as_fp8(fake, kv_dtype,  # noqa: F811
                                                            page_size) -> None:
    """The plans name fp8 as the KV dtype and the model's as the query's, the modules built
    are the mixed-precision ones, and the kernels get fp8 views (the fake refuses any other
    dtype) whose attention equals the torch backend's over the same pages."""
    from tests import fake_flashinfer

    head_dim = 64
    pools = [fp8_pool(kv_dtype, page_size, head_dim=head_dim) for _ in range(2)]
    shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim,
                 sliding_windows=(None, 5))
    flash = make_backend("flashinfer", pools[0], **shape)
    reference = TorchNativeBackend(pools[1], **shape)
    assert (flash.prefill_kernel, flash.decode_kernel) == ("fa2", "fa2")
    name = str(kv_dtype).removeprefix("torch.")
    assert all(f"float32_{name}_float32_int32" in spec for spec in fake_flashinfer.built[0])
    for kind in ("mixed", "decode"):
        batch = random_batch(page_size, pools[0].num_pages, SHAPES[kind])
        flash.plan(batch)
        reference.plan(batch)
        for layer in range(2):
            q, k, v = step_tensors(batch.num_tokens, kv_dtype, head_dim)
            torch.testing.assert_close(flash.forward(layer, q, k, v),
                                       reference.forward(layer, q, k, v), rtol=1e-4, atol=1e-4)
    assert torch.equal(pools[0].kv, pools[1].kv)


def test_resolving_fp8_and_the_backends_that_read_it() -> None:
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    cuda = torch.device("cuda")
    assert resolve_backend("flashinfer", cuda, torch.bfloat16, 64, torch.float8_e4m3fn) == (
        "flashinfer")
    assert resolve_backend("auto", torch.device("cpu"), torch.float32, 64,
                           torch.float8_e5m2) == "torch"
    with pytest.raises(ValueError, match="use --kv-cache-dtype fp8_e4m3"):
        resolve_backend("flashinfer", cuda, torch.bfloat16, 64, torch.int8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama"))


def test_fp8_buys_twice_the_pages_of_bf16_and_serves_steps(checkpoint) -> None:
    """At the same --kv-cache-gb an fp8 cache holds twice bf16's pages; a runner over it
    prefills and decodes with logits close to a full-precision cache's (int8's for scale)."""
    pages = {kv: ModelRunner(EngineConfig(model=checkpoint, dtype="bfloat16", page_size=4,
                                          kv_cache_dtype=kv, kv_cache_gb=0.01)).num_pages
             for kv in ("auto", "fp8_e4m3", "fp8_e5m2")}
    assert pages["fp8_e4m3"] == pages["fp8_e5m2"] and pages["fp8_e4m3"] // 2 == pages["auto"]
    logits = {}
    for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
        runner = ModelRunner(EngineConfig(model=checkpoint, dtype="float32", page_size=4,
                                          kv_cache_dtype=kv, num_pages=16))
        prefill = runner.forward(BatchInput.build([(list(range(8)), 0, list(range(3, 30)))], 4))
        step = runner.forward(BatchInput.build([(list(range(8)), 27, [5])], 4))
        logits[kv] = torch.cat([prefill[-1:], step])
    full = logits.pop("auto")
    error = {kv: float((got - full).abs().max() / full.abs().max()) for kv, got in logits.items()}
    # int8 keeps a scale per row; e4m3 has 3 mantissa bits, e5m2 2: each coarser, all small
    assert error["int8"] < error["fp8_e4m3"] < error["fp8_e5m2"] < 0.5, error
    assert error["fp8_e4m3"] < 0.15, error
