"""Sliding-window layers holding only their window (``--sliding-kv-ratio``), served end to end
in-process (scheduler and worker) on a small Gemma-3-shaped model: two sliding layers with a
16-token window, then a full one; prompts of several windows, at page sizes 1 and 16.

Greedy tokens equal transformers' cold, resent (a hit of all but the last token), as a next
turn (a hit of the whole history), forked (parallel samples), after the cache's windows were
evicted and under preemption; every running sequence holds at most its window's pages plus
one once its prompt is in; the accounting of both pools holds after every step (the harness's
``check``). Combinations the sliding pages do not support are refused with a sentence
(the host tier: tests/test_sliding_host.py; the disk tier: tests/test_sliding_disk.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.worker.process import Worker
from tests.conftest_models import load_reference, write_checkpoint
from tests.test_scheduler import Harness, hf_beams, hf_greedy

WINDOW = 16
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return str(write_checkpoint(
        tmp_path_factory.mktemp("gemma3_window") / "model", "gemma3", sliding_window=WINDOW,
        num_hidden_layers=3, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    return load_reference(gemma_dir)


class WindowHarness(Harness):
    """Each step as it is planned: every sequence in it whose prompt is in holds the sliding
    KV of at most its window's pages plus one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        schedule = self.sched.schedule

        def planned():
            batch = schedule()
            if batch is not None:
                self.check_windows(self.sched.inflight[-1][1])
            return batch

        self.sched.schedule = planned

    def check_windows(self, entries) -> None:
        sliding = self.sched.tree.sliding
        bound = -(-sliding.window // sliding.page_size) + 1
        for entry in entries:
            seq = entry.seq
            if entry.extend == 1 and seq.settled >= seq.req.prompt_len:
                held = len(seq.pages) - seq.lease.swa_from
                assert held <= bound, f"{seq.req.rid} holds {held} window pages"


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, int(rng.integers(60, 140))).tolist() for _ in range(count)]


def serve_cold_and_resent(h: Harness, hf_gemma) -> list[list[int]]:
    """Three prompts of several windows served cold (greedy tokens equal transformers'), then
    resent (all but each one's last token hit, the same tokens); the prompts."""
    cold = prompts(3, seed=0)
    for i, p in enumerate(cold):
        h.add(f"a{i}", p, GREEDY)
    h.run()
    for i, p in enumerate(cold):
        assert h.outputs[f"a{i}"][0] == hf_greedy(hf_gemma, p, 20), f"a{i}"
    for i, p in enumerate(cold):  # exact resends: the window where each prompt ends is kept
        h.add(f"b{i}", p, GREEDY)
    h.run()
    for i, p in enumerate(cold):
        assert h.finals[f"b{i}"][0].cached_tokens == len(p) - 1
        assert h.outputs[f"b{i}"][0] == h.outputs[f"a{i}"][0]
    return cold


@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_decode_like_transformers_cold_resent_as_next_turn_and_forked(
        gemma_dir, hf_gemma, page_size):
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, chunked_prefill_size=24, max_prefill_tokens=64)
    pool = h.worker.runner.pool
    assert pool.kv.shape[0] == 1 and pool.swa.shape[0] == 2  # the full layer, the sliding two
    assert pool.swa.shape[2] == pool.kv.shape[2] // 2
    cold = serve_cold_and_resent(h, hf_gemma)
    turn = cold[0] + h.outputs["a0"][0] + [5, 6, 7]  # the next turn: history, a new message
    h.add("turn", turn, GREEDY)
    forked = prompts(1, seed=3)[0]
    h.add("fork", forked, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2))
    h.run()
    # the last output's KV was never computed: all of the history before it hits
    assert h.finals["turn"][0].cached_tokens == len(cold[0]) + 19
    assert h.outputs["turn"][0] == hf_greedy(hf_gemma, turn, 20)
    expected = hf_greedy(hf_gemma, forked, 20)
    assert h.outputs["fork"][0] == h.outputs["fork"][1] == expected
    stats = h.sched.stats()
    assert stats["sliding_pages_total"] == pool.swa.shape[2]
    assert stats["sliding_pages_used"] == 0 and stats["sliding_pages_cached"] > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_evicted_and_requests_preempted_keep_the_tokens(gemma_dir, hf_gemma, page_size):
    """A pool too small for the load: requests are preempted (recomputed from what the cache
    still holds), and cached windows are evicted to make room, leaving their full KV."""
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=320 // page_size,
                      sliding_kv_ratio=0.3, chunked_prefill_size=24, max_prefill_tokens=48)
    wave = prompts(8, seed=1)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(wave):
        h.add(f"a{i}", p, params)
    h.run()
    for i, p in enumerate(wave):  # again: some windows were evicted, some hit
        h.add(f"b{i}", p, params)
    h.run()
    assert h.sched.num_preemptions > 0
    assert h.sched.tree.stats.sliding_evicted_pages > 0
    for i, p in enumerate(wave):
        expected = hf_greedy(hf_gemma, p, 48)
        assert h.outputs[f"a{i}"][0] == expected and h.outputs[f"b{i}"][0] == expected, i
    sliding = h.sched.tree.sliding.allocator
    assert sliding.num_pinned_pages == 0
    h.sched.tree.reset()
    assert sliding.num_free_pages == sliding.num_pages


def test_combinations_not_supported_are_refused(gemma_dir, harness_model_dir, tmp_path):
    EngineConfig(model=gemma_dir, sliding_kv_ratio=0.5, disk_cache_dir=str(tmp_path)).validate()
    EngineConfig(model=gemma_dir, sliding_kv_ratio=0.5, enable_cuda_graph=True).validate()
    with pytest.raises(ValueError, match="needs a model with sliding-window layers"):
        Worker(EngineConfig(model=harness_model_dir, sliding_kv_ratio=0.5, dtype="float32",
                            quantization="none"))
    with pytest.raises(ValueError, match="fewer than one prompt chunk and its window need"):
        Worker(EngineConfig(model=gemma_dir, sliding_kv_ratio=0.01, num_pages=64,
                            dtype="float32", quantization="none"))


def test_full_kv_for_sliding_layers_is_unchanged_without_the_option(gemma_dir):
    worker = Worker(EngineConfig(model=gemma_dir, num_pages=32, dtype="float32",
                                 quantization="none"))
    assert worker.runner.pool.kv.shape[0] == 3 and worker.runner.pool.swa.numel() == 0
    assert worker.info.num_sliding_pages == 0
    torch.testing.assert_close(worker.runner.pool.kv.sum(), torch.tensor(0.0))


@pytest.mark.parametrize("page_size", [1, 16])
def test_beams_over_windows_match_transformers(gemma_dir, hf_gemma, page_size):
    """Beams fork and drop each other's tables every step: their windows move with them."""
    prompt = prompts(1, seed=5)[0]
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, chunked_prefill_size=24, max_prefill_tokens=64)
    h.add("beam", prompt, SamplingParams(max_tokens=24, beam_width=3, n=2))
    h.run()
    assert [h.outputs["beam"][i] for i in range(2)] == hf_beams(hf_gemma, prompt, 24)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "int8"),
                                                     ("bfloat16", "auto")])
def test_windows_decode_what_full_kv_decodes_in_other_kv_dtypes(gemma_dir, dtype,
                                                                kv_cache_dtype):
    """8-bit rows (their scales inside) and a bf16 model's pages through the sliding layers'
    own pages give the tokens the same cache gives with full KV in every layer."""
    outputs = []
    for ratio in (0.0, 0.5):
        h = Harness(gemma_dir, page_size=16, num_pages=128, sliding_kv_ratio=ratio,
                    dtype=dtype, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=24,
                    max_prefill_tokens=64)
        for i, p in enumerate(prompts(2, seed=7)):
            h.add(f"a{i}", p, GREEDY)
        h.run()
        outputs.append(h.outputs)
    assert outputs[0] == outputs[1]
