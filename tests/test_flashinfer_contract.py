"""The flashinfer backend's side of FlashInfer's contract, on CPU.

``tests/fake_flashinfer.py`` stands in for flashinfer-python 0.6.1: it computes attention in
plain torch from exactly the page tables, windows and buffers the backend hands it, and checks
what FlashInfer checks. So the backend's plans (prefill, decode, mixed, page sizes 1 and 16,
sliding windows, CUDA-graph buffers shared by every batch size), the staged page indices and
the kernel modules it prebuilds are all exercised here; only FlashInfer's own kernels are not
(scripts/gpu_phase.py runs them on a GPU: docs/gpu.md)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import engine.worker.attention.flashinfer as flashinfer_backend
from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.attention import TorchNativeBackend, make_backend
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.kv_pool import KVPool
from engine.worker.runner import ModelRunner
from engine.worker.staging import HostStaging
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
    # The runner's way: slots and the plan's arrays staged in one pack.
    out_slots, *staged = HostStaging(torch.device("cpu")).stage(
        [batch.out_slots.astype(np.int64), *flash.staged_arrays(batch)])
    flash.plan(batch, out_slots.on_device, staged=staged)
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


def fake_runner_config(checkpoint, num_pages: int) -> EngineConfig:
    """A CPU runner on the fake flashinfer, decode graphs asked for up to batch 8."""
    return EngineConfig(model=str(checkpoint), page_size=4, num_pages=num_pages,
                        dtype="float32", device="cpu", attention_backend="flashinfer",
                        enable_cuda_graph=True, cuda_graph_max_bs=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # GQA 8 query heads over 2 KV heads of 64: tensor-core decode
    return write_checkpoint(tmp_path_factory.mktemp("llama64"), "llama", hidden_size=128,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def test_graph_steps_use_the_shared_fixed_buffers_correctly(fake, checkpoint) -> None:
    """Decode through DecodeGraphs' padded steps and the CUDA-graph decode wrappers (every
    batch size planned over prefixes of one set of buffers, sizes interleaved so stale entries
    would show) gives the eager decode's logits."""
    runner = ModelRunner(fake_runner_config(checkpoint, 128))
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
    runner = ModelRunner(fake_runner_config(checkpoint, 16))
    graphs = DecodeGraphs(runner, 8, capture=False)
    capacity = len(runner.attention._graph_buffers[False][1])  # 4 per pool page, plus 8
    pages = list(range(16))
    fits = BatchInput.build([(pages, 60, [1])] * 4, 4)
    assert graphs.bucket_for(fits) == 4
    too_many = BatchInput.build([(pages, 60, [1])] * ((capacity - 8) // 16 + 1), 4)
    assert too_many.num_seqs <= 8 and graphs.bucket_for(too_many) is None


def test_workspace_holds_graph_decode_of_a_64_head_model_at_batch_256(fake) -> None:
    """64 query heads over 8 KV heads of 128 (tensor-core decode): a graph step of 256
    sequences splits into 383 work items of 16 rows, ~202 MB of partial outputs, past the old
    fixed 128 MiB; the workspace sized from the model holds it."""
    need = fake_flashinfer.graph_split_bytes(256, 64, 8, 128, tensor_cores=True)
    assert need == 64 * 383 * 16 * 129 * 4 > flashinfer_backend.MIN_WORKSPACE_BYTES
    pool = KVPool(num_layers=1, num_pages=300, page_size=1, num_kv_heads=8, head_dim=128,
                  dtype=torch.float32, device="cpu")
    flash = flashinfer_backend.FlashInferBackend(
        pool, num_heads=64, num_kv_heads=8, head_dim=128, sliding_windows=(None,),
        graph_max_batch=256)
    assert flash.workspace_bytes >= need
    flash.prepare_graphs(256)
    decode = BatchInput.build([([i], 0, [1]) for i in range(256)], 1)
    flash.plan(decode, graph=True)  # the fake fails as FlashInfer does when it does not fit
    small = flashinfer_backend.FlashInferBackend(
        pool, num_heads=64, num_kv_heads=8, head_dim=128, sliding_windows=(None,))
    with pytest.raises(ValueError, match="sized for CUDA graphs up to batch 0, not 256"):
        small.prepare_graphs(256)


def test_workspace_is_sized_from_heads_head_dim_and_the_largest_batch() -> None:
    size = flashinfer_backend.workspace_bytes
    llama3_8b = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, num_sms=132)
    base = size(**llama3_8b, graph_max_batch=0)
    assert base >= flashinfer_backend.MIN_WORKSPACE_BYTES
    assert size(**llama3_8b, graph_max_batch=4096) > base  # graphs past the eager bound
    assert size(num_qo_heads=64, num_kv_heads=8, head_dim=256, num_sms=132,
                graph_max_batch=256) > size(num_qo_heads=64, num_kv_heads=8, head_dim=128,
                                            num_sms=132, graph_max_batch=256)
    for heads, kv_heads in ((8, 8), (32, 8), (64, 8), (128, 8)):
        for batch in (1, 64, 256, 512):
            for tensor_cores in (True, False):
                need = fake_flashinfer.graph_split_bytes(batch, heads, kv_heads, 128,
                                                         tensor_cores)
                assert size(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                            num_sms=132, graph_max_batch=batch) >= need


def test_fa3_serves_only_where_its_modules_are_built(fake, monkeypatch) -> None:
    """On Hopper FlashInfer picks FA3; a start never waits for its build: FA2 serves until the
    FA3 modules are in the cache, and an explicit ``decode_backend="fa3"`` is honoured."""
    monkeypatch.setattr(fake.utils, "determine_attention_backend", lambda *args: "fa3")
    flash, _ = backends(8, 2, 16, decode_backend="auto")
    assert (flash.prefill_kernel, flash.decode_kernel) == ("fa2", "fa2")
    assert all("_fa3_" not in name for name in fake_flashinfer.built[-1])
    # FA3 built beforehand, as scripts/gpu_phase.py's phase 1 does when time allows.
    fake.jit.build_jit_specs(flashinfer_backend.jit_specs(
        torch.float32, HEAD_DIM, [w is not None for w in WINDOWS], True, "fa3", "fa3"))
    again, _ = backends(8, 2, 16, decode_backend="auto")
    assert (again.prefill_kernel, again.decode_kernel) == ("fa3", "fa3")
    assert {w.backend for w in again._prefill.values()} == {"fa3"}
