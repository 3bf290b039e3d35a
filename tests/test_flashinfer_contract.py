"""The flashinfer backend's side of FlashInfer's contract, on CPU.

``tests/fake_flashinfer.py`` stands in for flashinfer-python 0.6.1: it computes attention in
plain torch from exactly the page tables, windows and buffers the backend hands it, and checks
what FlashInfer checks. So the backend's plans (prefill, decode, mixed, page sizes 1 and 16,
sliding windows, CUDA-graph buffers shared by every batch size), the staged page indices and
the kernel modules it prebuilds are all exercised here; only FlashInfer's own kernels are not
(scripts/gpu_check.sh runs them on a GPU)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import engine.worker.attention.flashinfer as flashinfer_backend
from engine.contracts.step import BatchInput
from engine.worker.attention import TorchNativeBackend, make_backend
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.kv_pool import KVPool
from engine.worker.runner import ModelRunner
from tests import fake_flashinfer
from tests.conftest_models import one_torch_thread, write_checkpoint
from tests.test_attention import SHAPES, random_batch

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

HEAD_DIM = 64  # a size FlashInfer has kernels for
WINDOWS = (None, 5)


@pytest.fixture
def fake(monkeypatch):
    module = fake_flashinfer.module()
    for name, value in (("flashinfer", module), ("flashinfer.jit", module.jit),
                        ("flashinfer.utils", module.utils)):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setattr(flashinfer_backend, "import_flashinfer", lambda: module)
    monkeypatch.setattr(flashinfer_backend, "check_pool", lambda pool: None)  # CPU, fp32
    fake_flashinfer.built.clear()
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances.clear()
    return module


def make_pool(page_size: int, kv_heads: int) -> KVPool:
    pool = KVPool(num_layers=len(WINDOWS), num_pages=512 // page_size, page_size=page_size,
                  num_kv_heads=kv_heads, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    pool.kv.normal_()
    return pool


def backends(heads: int, kv_heads: int, page_size: int, **options):
    pool = make_pool(page_size, kv_heads)
    twin = make_pool(page_size, kv_heads)
    twin.kv.copy_(pool.kv)
    shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
                 sliding_windows=WINDOWS)
    return (make_backend("flashinfer", pool, **shape, **options),
            TorchNativeBackend(twin, **shape))


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 4)], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flashinfer_plans_attend_like_the_torch_backend(fake, heads, kv_heads, page_size,
                                                       shape) -> None:
    flash, reference = backends(heads, kv_heads, page_size)
    assert flash.tensor_cores == (heads // kv_heads >= 4)
    batch = random_batch(page_size, 512 // page_size, SHAPES[shape])
    # The runner's way: slots and page indices already on the device (staged).
    out_slots = torch.from_numpy(batch.out_slots.astype(np.int64))
    staged = [torch.from_numpy(a) for a in flash.device_arrays(batch)]
    flash.plan(batch, out_slots, staged=staged)
    reference.plan(batch)
    gen = torch.Generator().manual_seed(0)
    for layer in range(len(WINDOWS)):
        q, k, v = (torch.randn(batch.num_tokens, h, HEAD_DIM, generator=gen)
                   for h in (heads, kv_heads, kv_heads))
        torch.testing.assert_close(flash.forward(layer, q, k, v),
                                   reference.forward(layer, q, k, v), rtol=1e-4, atol=1e-4)


def test_prebuild_builds_the_modules_the_plans_load(fake) -> None:
    flash, _ = backends(8, 2, 16)  # tensor-core decode: a prefill module of the decode backend
    assert len(fake_flashinfer.built) == 1  # warm-up prebuilt, in one call
    names = fake_flashinfer.built[0]
    assert sorted(names) == sorted(s.name for s in flash.jit_specs())
    # per window kind (none, sliding): the fa2 prefill module serves prefill and decode
    assert len(names) == 2 and {n.split("_")[1] for n in names} == {"fa2"}
    assert all("float32_float32_float32_int32_64_64_0_" in n for n in names)
    fa3, _ = backends(8, 2, 16, decode_backend="fa3")
    assert {s.name.split("_")[1] for s in fa3.jit_specs()} == {"fa2", "fa3"}
    cuda_cores, _ = backends(8, 4, 16)
    kinds = sorted(s.name.split("_")[0] for s in cuda_cores.jit_specs())
    assert kinds == ["decode", "decode", "prefill", "prefill"]
    decoders = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances
    assert {w.backend for w in decoders} == {"fa2", "fa3"}
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        backends(8, 2, 16, decode_backend="fa4")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # GQA 8 query heads over 2 KV heads of 64: tensor-core decode
    return write_checkpoint(tmp_path_factory.mktemp("llama64"), "llama", hidden_size=128,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_graph_steps_use_the_shared_fixed_buffers_correctly(fake, checkpoint) -> None:
    """Decode through DecodeGraphs' padded steps and the CUDA-graph decode wrappers (every
    batch size planned over prefixes of one set of buffers, sizes interleaved so stale entries
    would show) gives the eager decode's logits."""
    runner = ModelRunner(checkpoint, page_size=4, num_pages=128, dtype="float32", device="cpu",
                         attention_backend="flashinfer", cuda_graph_max_bs=8)
    graphs = DecodeGraphs(runner, 8, capture=False)
    rng = np.random.default_rng(0)
    free = list(rng.permutation(128))
    seqs = []
    for length in rng.integers(3, 30, 8):
        pages = [int(free.pop()) for _ in range(-(-(int(length) + 3) // 4))]
        runner.forward(BatchInput.build([(pages, 0, rng.integers(0, 90, int(length)))], 4))
        seqs.append((pages, int(length)))
    for step, size in enumerate([8, 2, 5, 1, 8, 3]):
        chosen = [seqs[i] for i in rng.choice(8, size, replace=False)]
        batch = BatchInput.build([(p, n + step // 2, [7]) for p, n in chosen], 4)
        bucket = graphs.bucket_for(batch)
        assert bucket is not None
        eager = runner.forward(batch)
        graph = graphs.run(batch, bucket)
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    graph_wrappers = [w for w in fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances
                      if w.use_cuda_graph]
    assert {len(w.last_page_len) for w in graph_wrappers} == {1, 2, 4, 8}
    assert len({w.indices.data_ptr() for w in graph_wrappers}) == 1  # one shared index buffer


def test_graphs_leave_steps_with_too_many_pages_to_eager(fake, checkpoint) -> None:
    runner = ModelRunner(checkpoint, page_size=4, num_pages=16, dtype="float32", device="cpu",
                         attention_backend="flashinfer", cuda_graph_max_bs=8)
    graphs = DecodeGraphs(runner, 8, capture=False)
    capacity = len(runner.attention._graph_buffers[1])  # 4 per pool page, plus 8
    pages = list(range(16))
    fits = BatchInput.build([(pages, 60, [1])] * 4, 4)
    assert graphs.bucket_for(fits) == 4
    too_many = BatchInput.build([(pages, 60, [1])] * ((capacity - 8) // 16 + 1), 4)
    assert too_many.num_seqs <= 8 and graphs.bucket_for(too_many) is None
