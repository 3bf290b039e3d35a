"""The flashinfer backend over the sliding layers' own pages (``--sliding-kv-ratio``), on CPU
against ``tests/fake_flashinfer.py`` (its contract: tests/test_flashinfer_contract.py).

On a small Gemma-3-shaped model (two sliding layers with a 16-token window, then a full one;
head_dim 64, a size FlashInfer has kernels for) served in-process at ratio 0.5, greedy tokens
equal transformers' cold, resent and as a next turn, at page sizes 1 and 16. Every plan of the
sliding layers lists only the pages of each sequence's window (``window_left`` 15) and every
plan of the full layer all of its pages with no window; each layer runs its kind's wrappers
over its own pool tensor. With CUDA graphs (through ``DecodeGraphs(capture=False)``: the
replay's padding, fixed buffers and plans, run eagerly) the same tokens come out, each layer
kind planning over its own fixed buffers and the padding rows writing only the scratch pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.worker.cuda_graphs import DecodeGraphs
from tests import fake_flashinfer
from tests.conftest_models import load_reference, one_torch_thread, write_checkpoint
from tests.test_flashinfer_contract import fake
from tests.test_scheduler import hf_greedy
from tests.test_sliding_kv import GREEDY, WINDOW, WindowHarness, serve_cold_and_resent

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__, fake.__name__)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return str(write_checkpoint(
        tmp_path_factory.mktemp("gemma3_window64") / "model", "gemma3", sliding_window=WINDOW,
        num_hidden_layers=3, max_position_embeddings=512, head_dim=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    return load_reference(gemma_dir)


def record_plans(monkeypatch) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(window_left, pages per sequence, new tokens per sequence) of every plan the fake's
    wrappers receive."""
    plans = []
    decode = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper
    prefill = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper
    decode_plan, prefill_plan = decode.plan, prefill.plan

    def on_decode(self, indptr, *args, window_left=-1, **kwargs):
        plans.append((window_left, np.diff(indptr.numpy()), np.ones(len(indptr) - 1)))
        return decode_plan(self, indptr, *args, window_left=window_left, **kwargs)

    def on_prefill(self, qo_indptr, kv_indptr, *args, window_left=-1, **kwargs):
        plans.append((window_left, np.diff(kv_indptr.numpy()), np.diff(qo_indptr.numpy())))
        return prefill_plan(self, qo_indptr, kv_indptr, *args, window_left=window_left,
                            **kwargs)

    monkeypatch.setattr(decode, "plan", on_decode)
    monkeypatch.setattr(prefill, "plan", on_prefill)
    return plans


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_serves_the_sliding_pool_like_transformers(monkeypatch, gemma_dir, hf_gemma,
                                                              page_size):
    plans = record_plans(monkeypatch)
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, attention_backend="flashinfer", chunked_prefill_size=24,
                      max_prefill_tokens=64)
    runner = h.worker.runner
    assert runner.attention.name == "flashinfer"
    assert runner.pool.kv.shape[0] == 1 and runner.pool.swa.shape[0] == 2
    plans.clear()  # the warm-up's
    cold = serve_cold_and_resent(h, hf_gemma)
    turn = cold[0] + h.outputs["a0"][0] + [5, 6, 7]  # the next turn: history, a new message
    h.add("turn", turn, GREEDY)
    h.run()
    assert h.finals["turn"][0].cached_tokens == len(cold[0]) + 19
    assert h.outputs["turn"][0] == hf_greedy(hf_gemma, turn, 20)

    # Each step planned both kinds: the full layer over whole contexts, the sliding layers
    # over their windows' pages only (a query row's window reaches W - 1 keys back).
    kinds = {left for left, _, _ in plans}
    assert kinds == {-1, WINDOW - 1}
    windowed = [(pages, new) for left, pages, new in plans if left == WINDOW - 1]
    longest_full = max(int(pages.max()) for left, pages, _ in plans if left == -1)
    assert longest_full * page_size > 2 * WINDOW  # contexts of several windows
    for pages, new in windowed:
        bound = -(-(WINDOW - 1 + new) // page_size) + 1
        assert np.all(pages <= bound), (pages, new)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_decode_over_the_sliding_pool_like_transformers(monkeypatch, gemma_dir,
                                                                   hf_gemma, page_size):
    """Decode steps through the graphs' padded fixed buffers (``capture=False``: the replay's
    padding, buffers and plans, run eagerly): greedy tokens equal transformers' cold, resent
    and as a next turn, three sequences padded to the bucket of 4; the padding rows write only
    the two scratch pages, and every page comes back."""
    import engine.worker.runner

    monkeypatch.setattr(engine.worker.runner.ModelRunner, "_why_no_graphs", lambda self: None)
    monkeypatch.setattr(engine.worker.runner, "DecodeGraphs",
                        lambda runner, max_batch: DecodeGraphs(runner, max_batch, capture=False))
    buckets = []
    run = DecodeGraphs.run

    def counted(self, batch, bucket, **kwargs):
        buckets.append((batch.num_seqs, bucket))
        return run(self, batch, bucket, **kwargs)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, attention_backend="flashinfer", chunked_prefill_size=24,
                      max_prefill_tokens=64, enable_cuda_graph=True, cuda_graph_max_bs=8)
    runner = h.worker.runner
    assert runner.graphs is not None and runner.swa_scratch_page == runner.num_sliding_pages
    assert runner.pool.swa.shape[2] == runner.num_sliding_pages + 1
    cold = serve_cold_and_resent(h, hf_gemma)
    turn = cold[0] + h.outputs["a0"][0] + [5, 6, 7]
    h.add("turn", turn, GREEDY)
    h.run()
    assert h.outputs["turn"][0] == hf_greedy(hf_gemma, turn, 20)
    assert (3, 4) in buckets and (1, 1) in buckets  # padded and unpadded graph steps
    # the padding rows wrote the scratch pages of both pools, nothing else of theirs
    assert runner.pool.kv[:, :, runner.scratch_page].abs().sum() > 0
    assert runner.pool.swa[:, :, runner.swa_scratch_page].abs().sum() > 0
    # each kind's graph wrappers plan over that kind's own fixed index buffer
    buffers = {kind: b[1].data_ptr() for kind, b in runner.attention._graph_buffers.items()}
    planned = {(w.planned["window_left"], w.indices.data_ptr())
               for w in fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances
               if w.use_cuda_graph and w.indices.data_ptr() in buffers.values()}
    assert planned == {(WINDOW - 1, buffers[True]), (-1, buffers[False])}
    sliding = h.sched.tree.sliding.allocator
    assert sliding.num_pinned_pages == 0
    h.sched.tree.reset()
    assert sliding.num_free_pages == sliding.num_pages
    assert h.sched.alloc.num_free_pages == h.sched.alloc.num_pages
