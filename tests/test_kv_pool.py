"""The KV pool does exactly the writes, copies and swaps it is told; BatchInput encodes the page
convention (slot = pages[i // P] * P + i % P) and rejects batches that break it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import decode, encode
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.step import BatchInput
from engine.contracts.worker_messages import ForwardBatch, RowSampling
from engine.worker.kv_pool import KVPool
from engine.worker.runner import ModelRunner
from tests.conftest_models import write_checkpoint


def make_pool(
    page_size: int = 4,
    num_pages: int = 8,
    num_host_pages: int = 4,
    dtype: torch.dtype = torch.float32,
) -> KVPool:
    return KVPool(
        num_layers=3,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=2,
        head_dim=5,
        dtype=dtype,
        device="cpu",
        num_host_pages=num_host_pages,
    )


def test_write_lands_in_the_named_slots_of_one_layer() -> None:
    pool = make_pool()
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    pool.write(1, torch.tensor([0, 9, 31]), k, v)
    k_pages, v_pages = pool.layer(1)
    for row, slot in enumerate([0, 9, 31]):
        assert torch.equal(k_pages[slot // 4, slot % 4], k[row])
        assert torch.equal(v_pages[slot // 4, slot % 4], v[row])
    assert int((pool.kv != 0).sum()) == 2 * k.numel()  # nothing else, no other layer


def test_copy_pages_copies_only_the_head_of_each_source_page() -> None:
    pool = make_pool()
    pool.kv.normal_()
    before = pool.kv.clone()
    pool.copy_pages(np.array([[2, 5, 3], [6, 0, 4]], dtype=np.int32))
    assert torch.equal(pool.kv[:, :, 5, :3], before[:, :, 2, :3])
    assert torch.equal(pool.kv[:, :, 5, 3:], before[:, :, 5, 3:])  # tail of a partial copy kept
    assert torch.equal(pool.kv[:, :, 0], before[:, :, 6])
    untouched = [p for p in range(8) if p not in (0, 5)]
    assert torch.equal(pool.kv[:, :, untouched], before[:, :, untouched])


def test_swap_out_then_in_restores_pages_elsewhere() -> None:
    pool = make_pool()
    pool.kv.normal_()
    original = pool.kv[:, :, [1, 4]].clone()
    pool.swap_out(np.array([[1, 3], [4, 0]]))
    pool.kv.zero_()
    pool.swap_in(np.array([[3, 6], [0, 2]]))
    assert torch.equal(pool.kv[:, :, [6, 2]], original)
    assert int((pool.kv[:, :, [0, 1, 3, 4, 5, 7]] != 0).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swaps_of_mixed_sizes_round_trip_exactly(dtype: torch.dtype) -> None:
    """Several calls of different sizes out, the device pages overwritten, several calls back
    in to other pages, mixing host pages of different calls: every layer's K and V exact."""
    pool = make_pool(num_pages=10, num_host_pages=7, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    swapped_out = [0, 3, 4, 7, 9, 5]
    original = pool.kv[:, :, swapped_out].clone()
    pool.swap_out(np.array([[0, 6]]))
    pool.swap_out(np.array([[3, 2], [4, 0], [7, 5]]))
    pool.swap_out(np.array([[9, 1], [5, 3]]))
    host_of = {0: 6, 3: 2, 4: 0, 7: 5, 9: 1, 5: 3}
    pool.kv.copy_(torch.randn(pool.kv.shape))  # the pages are reused by other sequences
    untouched_host = pool.host[:, :, 4].clone()
    moved_to = {3: 8, 9: 0, 0: 3, 5: 1, 7: 6, 4: 2}
    calls = [[3, 9], [0, 5, 7, 4]]  # sizes 2 then 4, against 1, 3 and 2 on the way out
    for call in calls:
        pool.swap_in(np.array([[host_of[page], moved_to[page]] for page in call]))
    for i, page in enumerate(swapped_out):
        assert torch.equal(pool.kv[:, :, moved_to[page]], original[:, :, i]), page
    assert torch.equal(pool.host[:, :, 4], untouched_host)  # a host page no pair named


def test_host_pages_are_free_once_swap_in_returns() -> None:
    # swap_in reads its host pages before returning: a swap_out into them right after must not
    # reach the pages just swapped in.
    pool = make_pool()
    pool.kv.normal_()
    original = pool.kv[:, :, [2, 5]].clone()
    pool.swap_out(np.array([[2, 0], [5, 1]]))
    pool.swap_in(np.array([[0, 6], [1, 7]]))
    pool.swap_out(np.array([[3, 0], [4, 1]]))
    assert torch.equal(pool.kv[:, :, [6, 7]], original)
    assert torch.equal(pool.host[:, :, [0, 1]], pool.kv[:, :, [3, 4]])


def test_bytes_per_page_counts_k_and_v_of_every_layer() -> None:
    size = KVPool.bytes_per_page(
        num_layers=3, page_size=4, num_kv_heads=2, head_dim=5, dtype=torch.bfloat16
    )
    assert size == 3 * 2 * 4 * 2 * 5 * 2


def test_runner_sizes_the_pool_from_pages_gigabytes_or_the_cpu_default(tmp_path) -> None:
    path = write_checkpoint(tmp_path / "llama", "llama")
    # llama kind: 2 layers, 2 KV heads of 16 -> 2 * 2 * 2 * 16 * 4 bytes per slot in float32
    slot_bytes = 2 * 2 * 2 * 16 * 4
    runner = ModelRunner(EngineConfig(model=str(path), kv_cache_gb=1 / 1024, dtype="float32"))
    assert runner.num_pages == 2**20 // (16 * slot_bytes)
    assert runner.dtype == torch.float32 and runner.attention_backend == "torch"
    assert runner.pool.kv.shape == (2, 2, runner.num_pages, 16, 2, 16)
    runner = ModelRunner(EngineConfig(model=str(path), page_size=1, dtype="bfloat16"))
    assert runner.num_pages == 2**30 // (slot_bytes // 2)
    assert runner.config.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="the KV cache gets no pages"):
        ModelRunner(EngineConfig(model=str(path), kv_cache_gb=1e-9))
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelRunner(EngineConfig(model=str(path), num_pages=4, dtype="float8"))


def test_build_follows_the_page_convention() -> None:
    batch = BatchInput.build([([7, 2], 3, [11, 12]), ([5, 1, 0], 0, [13])], page_size=4)
    assert batch.positions.tolist() == [3, 4, 0]
    assert batch.extend_lens.tolist() == [2, 1] and batch.seq_lens.tolist() == [5, 1]
    # pages beyond ceil(seq_len / P) are dropped from the table
    assert batch.page_indptr.tolist() == [0, 2, 3] and batch.page_indices.tolist() == [7, 2, 5]
    assert batch.out_slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 5 * 4]
    assert batch.resolved_logits_rows().tolist() == [1, 2]
    assert batch.last_page_lens(4).tolist() == [1, 1]
    assert not batch.is_decode
    batch.validate(page_size=4, num_pages=8)


def test_a_step_crosses_the_wire_unchanged() -> None:
    """The step the scheduler builds is the step the worker runs: every array (2-D copies and
    swaps included) comes back equal, int32, as a view of the message; other arrays and dtypes
    are refused rather than silently cast."""
    step = BatchInput.build([([7, 2], 3, [11, 12]), ([5, 1, 0], 0, [13])], page_size=4,
                            copies=[(7, 6, 3)], swap_out=[(1, 0), (0, 1)])
    sampling = [RowSampling(SamplingParams(temperature=0.0), 0)]
    got = decode(encode(ForwardBatch(batch_id=3, step=step, sampling=sampling)))
    assert isinstance(got, ForwardBatch) and got.batch_id == 3 and got.sampling == sampling
    for name in step.__struct_fields__:
        sent, back = getattr(step, name), getattr(got.step, name)
        assert back.dtype == np.int32 and back.shape == sent.shape, name
        assert (back == sent).all(), name
    got.step.validate(page_size=4, num_pages=8, num_host_pages=2)
    step.input_ids = np.array([1.5, 2.0])
    with pytest.raises(TypeError, match="cannot encode ndarray float64"):
        encode(ForwardBatch(batch_id=4, step=step, sampling=sampling))


def test_build_rejects_too_few_pages_and_empty_sequences() -> None:
    with pytest.raises(ValueError, match="need 2 pages of 4"):
        BatchInput.build([([7], 3, [11, 12])], page_size=4)
    with pytest.raises(ValueError, match="no new tokens"):
        BatchInput.build([([7], 3, [])], page_size=4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("out_slots", np.array([29, 9], dtype=np.int32), "out_slots disagree"),
        ("positions", np.array([3, 5], dtype=np.int32), "positions must be"),
        ("page_indices", np.array([7, 9], dtype=np.int32), r"page_indices must lie in \[0, 8\)"),
        ("logits_rows", np.array([2], dtype=np.int32), "logits_rows"),
        ("copies", np.array([[7, 1, 5]], dtype=np.int32), "between 1 and 4 slots"),
        ("swap_out", np.array([[7, 4]], dtype=np.int32), "swap_out host pages"),
    ],
)
def test_validate_names_what_is_wrong(field: str, value: np.ndarray, message: str) -> None:
    batch = BatchInput.build([([7, 2], 3, [11, 12])], page_size=4)
    setattr(batch, field, value)
    with pytest.raises(ValueError, match=message):
        batch.validate(page_size=4, num_pages=8, num_host_pages=4)


def test_default_dtype_is_bf16_where_the_cpu_has_it_natively(monkeypatch) -> None:
    import engine.worker.runner as runner

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native, want in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(runner, "cpu_has_native_bf16", lambda native=native: native)
        assert runner.resolve_dtype(None, cpu) == want
        assert runner.resolve_dtype(None, cuda) == torch.bfloat16
        assert runner.resolve_dtype("fp32", cpu) == torch.float32
    flags = open("/proc/cpuinfo").read()
    monkeypatch.undo()
    assert runner.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
