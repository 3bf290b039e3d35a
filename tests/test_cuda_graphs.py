"""The GPU step path on CPU: one staged copy of a step's arrays, and decode through the CUDA-graph
buckets' padded fixed buffers (``DecodeGraphs(capture=False)``: the same padding, buffers and
plan as a replay, run eagerly; capturing itself needs CUDA: scripts/gpu_phase.py, docs/gpu.md)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.cuda_graphs import DecodeGraphs, bucket_sizes, pad_decode
from engine.worker.runner import ModelRunner
from engine.worker.staging import HostStaging
from tests.conftest_models import one_torch_thread, write_checkpoint

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

PAGE = 4
NUM_PAGES = 64


def cpu_config(checkpoint, num_pages: int, graph_max_batch: int) -> EngineConfig:
    """An fp32 CPU runner's options with decode graphs asked for up to ``graph_max_batch``."""
    return EngineConfig(model=str(checkpoint), page_size=PAGE, num_pages=num_pages,
                        dtype="float32", device="cpu", enable_cuda_graph=True,
                        cuda_graph_max_bs=graph_max_batch)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def runner(checkpoint) -> ModelRunner:
    return ModelRunner(cpu_config(checkpoint, NUM_PAGES, graph_max_batch=8))


def test_buckets_cover_every_size_up_to_the_largest() -> None:
    assert bucket_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(512)[-5:] == [256, 320, 384, 448, 512]


def test_staging_returns_each_array_in_its_dtype() -> None:
    staging = HostStaging(torch.device("cpu"))
    rng = np.random.default_rng(0)
    for size in (3, 1000, 0, 5000, 7):  # grows past its buffer, then reuses it
        arrays = [rng.integers(-2**40, 2**40, size), rng.integers(0, 99, size + 1, np.int32),
                  rng.random(size).astype(np.float32), np.zeros(0, dtype=np.int32)]
        staged = staging.stage(arrays)
        for array, both in zip(arrays, staged, strict=True):
            for tensor in (both.on_device, both.pinned):
                assert tensor.dtype == torch.from_numpy(array).dtype
                assert np.array_equal(tensor.numpy(), array)


def test_padding_rows_use_only_the_scratch_page() -> None:
    batch = BatchInput.build([([3, 5], 6, [11]), ([9], 0, [12])], PAGE)
    padded = pad_decode(batch, 4, scratch_page=64, page_size=PAGE)
    padded.validate(PAGE, 65)
    assert padded.num_seqs == 4 and padded.is_decode
    assert padded.page_indices.tolist() == [3, 5, 9, 64, 64]
    assert padded.out_slots.tolist()[1:] == [batch.out_slots[1], 256, 256]
    assert pad_decode(batch, 2, 64, PAGE) is batch


def test_graphs_are_off_on_cpu_but_the_scratch_page_is_there(runner, checkpoint,
                                                              caplog) -> None:
    assert runner.graphs is None and runner.scratch_page == NUM_PAGES
    assert runner.pool.kv.shape[2] == NUM_PAGES + 1 and runner.num_pages == NUM_PAGES
    with caplog.at_level(logging.WARNING, logger="engine.worker.runner"):
        other = ModelRunner(cpu_config(checkpoint, 8, graph_max_batch=4))
    assert other.graphs is None
    assert "CUDA graphs off: the model runs on cpu" in caplog.text


def prefill(runner: ModelRunner, rng: np.random.Generator, lengths: list[int]):
    """Sequences of these lengths prefilled on shuffled pages: (pages, length, next id)."""
    free = list(rng.permutation(NUM_PAGES))
    seqs = []
    for length in lengths:
        pages = [int(free.pop()) for _ in range(-(-(length + 1) // PAGE))]
        seqs.append((pages, length, rng.integers(3, 90, length).tolist()))
    runner.forward(BatchInput.build([(p, 0, ids) for p, _, ids in seqs], PAGE))
    return [(pages, length, [int(rng.integers(3, 90))]) for pages, length, _ in seqs]


@pytest.mark.parametrize("lengths", [[5], [3, 4, 8], [1, 7, 2, 12, 4, 3, 15, 6]])
def test_graph_decode_equals_eager_decode(runner: ModelRunner, lengths: list[int]) -> None:
    graphs = DecodeGraphs(runner, 8, capture=False)
    rng = np.random.default_rng(len(lengths))
    decode = BatchInput.build(prefill(runner, rng, lengths), PAGE)
    bucket = graphs.bucket_for(decode)
    assert bucket == next(b for b in graphs.buckets if b >= len(lengths))
    real_pages = np.setdiff1d(np.arange(NUM_PAGES), decode.page_indices)
    untouched = runner.pool.kv[:, :, real_pages].clone()
    eager = runner.forward(decode)
    kv_after_eager = runner.pool.kv[:, :, :NUM_PAGES].clone()
    padded = graphs.run(decode, bucket)
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    # Padding wrote only the scratch page: the real pages hold what eager decode wrote (to
    # rounding: a padded batch's GEMMs may take other kernels than the unpadded one's).
    torch.testing.assert_close(runner.pool.kv[:, :, :NUM_PAGES], kv_after_eager, rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(runner.pool.kv[:, :, real_pages], untouched)
    if bucket > len(lengths):
        assert runner.pool.kv[:, :, NUM_PAGES, 0].abs().sum() > 0


def test_steps_that_are_not_small_decodes_run_eagerly(runner: ModelRunner) -> None:
    graphs = DecodeGraphs(runner, 2, capture=False)
    one = ([0, 1], 5, [7])
    assert graphs.bucket_for(BatchInput.build([one], PAGE)) == 1
    assert graphs.bucket_for(BatchInput.build([one, ([2], 0, [3, 4])], PAGE)) is None  # prefill
    assert graphs.bucket_for(BatchInput.build([one, ([2, 3], 4, [3])], PAGE)) == 2
    assert graphs.bucket_for(BatchInput.build([one] * 3, PAGE)) is None  # past the largest
    beam = BatchInput.build([one], PAGE)
    beam.logits_rows = np.array([0, 0], dtype=np.int32)
    assert graphs.bucket_for(beam) is None


def test_a_failed_capture_leaves_eager_decode(checkpoint, monkeypatch, caplog) -> None:
    import engine.worker.runner

    def broken_capture(runner, max_batch):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.worker.runner.ModelRunner, "_why_no_graphs", lambda self: None)
    monkeypatch.setattr(engine.worker.runner, "DecodeGraphs", broken_capture)
    with caplog.at_level(logging.WARNING, logger="engine.worker.runner"):
        runner = ModelRunner(cpu_config(checkpoint, 8, graph_max_batch=4))
    assert runner.graphs is None
    assert "CUDA graphs off: capture failed (RuntimeError: operation not permitted" in caplog.text
    logits = runner.forward(BatchInput.build([([0, 1], 0, [5, 6, 7])], PAGE))
    assert torch.isfinite(logits).all()


class _ReplayedGraph:
    def replay(self) -> None:
        pass


def test_a_bucket_that_fails_to_capture_is_skipped_alone(runner, monkeypatch, caplog) -> None:
    def capture(graphs: DecodeGraphs, bucket: int):
        if bucket == 4:
            raise RuntimeError("CUDA out of memory")
        return _ReplayedGraph(), torch.zeros(bucket, 3)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    with caplog.at_level(logging.WARNING, logger="radixserve.cuda_graphs"):
        graphs = DecodeGraphs(runner, 8)
    assert graphs.buckets == [1, 2, 8]
    assert "CUDA graph for batch size 4 not captured (RuntimeError: CUDA out of memory)" in (
        caplog.text)
    one = ([0, 1], 5, [7])
    assert graphs.bucket_for(BatchInput.build([one] * 3, PAGE)) == 8  # the next larger one
    assert graphs.bucket_for(BatchInput.build([one] * 2, PAGE)) == 2


def test_no_bucket_captured_leaves_eager_decode(checkpoint, monkeypatch, caplog) -> None:
    import engine.worker.runner

    def capture(graphs: DecodeGraphs, bucket: int):
        raise RuntimeError(f"bucket {bucket} does not fit")

    monkeypatch.setattr(engine.worker.runner.ModelRunner, "_why_no_graphs", lambda self: None)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(cpu_config(checkpoint, 8, graph_max_batch=2))
    assert runner.graphs is None
    assert "batch size 2 not captured" in caplog.text and "batch size 1 not captured" in (
        caplog.text)
    assert "CUDA graphs off: no batch size could be captured" in caplog.text
