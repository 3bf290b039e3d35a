"""Swap preemption over sliding-window layers with pages of their own
(``--sliding-kv-ratio``): a swapped-out sequence's private pages go to the host pool, and those
of its window take their sliding pages along (``SeqMemory.swap_out``: to the sliding part of
the same host page); swapped back in, they get fresh sliding pages, and pages before the window
get none. On the small Gemma-3-shaped model of tests/test_sliding_kv.py (16-token window), at
page sizes 1 and 16: greedy tokens equal transformers' under a load that swaps, no page of
either pool and no host page leaks (the harness's accounting after every step, everything
free at the end).
"""

from __future__ import annotations

import pytest

from engine.contracts.sampling_params import SamplingParams
from scheduler.kv import SeqMemory
from tests.test_scheduler import hf_greedy
from tests.test_sliding_kv import WindowHarness, gemma_dir, hf_gemma, prompts  # noqa: F401

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


class SwapCount:
    """Counts the swaps ``SeqMemory`` plans: sequences out, full and sliding pages each way."""

    def __init__(self, monkeypatch) -> None:
        self.seqs = self.pages_out = self.sliding_out = self.sliding_in = 0
        swap_out, swap_in = SeqMemory.swap_out, SeqMemory.swap_in

        def counted_out(mem, seq, work):
            before, sliding = len(work.swap_out), len(work.swa_swap_out)
            swapped = swap_out(mem, seq, work)
            self.seqs += swapped
            self.pages_out += len(work.swap_out) - before
            self.sliding_out += len(work.swa_swap_out) - sliding
            return swapped

        def counted_in(mem, seq, work):
            sliding = len(work.swa_swap_in)
            swap_in(mem, seq, work)
            self.sliding_in += len(work.swa_swap_in) - sliding

        monkeypatch.setattr(SeqMemory, "swap_out", counted_out)
        monkeypatch.setattr(SeqMemory, "swap_in", counted_in)


@pytest.mark.parametrize("page_size", [1, 16])
def test_swapped_windows_come_back_and_decode_like_transformers(gemma_dir, hf_gemma, page_size,  # noqa: F811
                                                                monkeypatch):
    swaps = SwapCount(monkeypatch)
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=320 // page_size,
                      sliding_kv_ratio=0.3, chunked_prefill_size=24, max_prefill_tokens=48,
                      preemption_mode="swap", num_host_pages=512 // page_size)
    wave = prompts(8, seed=1)
    for i, p in enumerate(wave):
        h.add(f"a{i}", p, PARAMS)
    h.run()
    assert swaps.seqs > 0 and swaps.sliding_out > 0
    # every window swapped out came back; pages before a window (here at page size 1) move
    # without sliding KV
    assert swaps.pages_out >= swaps.sliding_out == swaps.sliding_in
    assert page_size == 16 or swaps.pages_out > swaps.sliding_out
    for i, p in enumerate(wave):
        assert h.outputs[f"a{i}"][0] == hf_greedy(hf_gemma, p, PARAMS.max_tokens), i
    mem = h.sched.mem
    assert len(mem.host_free) == mem.num_host_pages
    sliding = h.sched.tree.sliding.allocator
    assert sliding.num_pinned_pages == 0
    h.sched.tree.reset()
    assert sliding.num_free_pages == sliding.num_pages
    assert h.sched.alloc.num_free_pages == h.sched.alloc.num_pages


def test_a_step_names_sliding_swaps_only_within_the_pools(gemma_dir):  # noqa: F811
    """The worker's check: the sliding swaps' pages lie in the sliding pool and in the host
    pool's swap pages."""
    import numpy as np

    from engine.contracts.step import BatchInput

    h = WindowHarness(gemma_dir, page_size=16, num_pages=32, sliding_kv_ratio=0.5,
                      chunked_prefill_size=24, preemption_mode="swap", num_host_pages=4)
    runner = h.worker.runner
    assert runner.pool.host_swa.shape[2] == 4 and runner.pool.host_swa.shape[0] == 2
    step = BatchInput.build([([0, 1], 0, list(range(3, 20)))], 16)
    step.swa_page_indices, step.swa_out_slots, step.swa_copies = (
        np.array([0, 1], np.int32), np.arange(17, dtype=np.int32), step.copies)
    step.swa_swap_out = np.array([[1, 4]], np.int32)
    with pytest.raises(ValueError, match="sliding swap_out host pages must lie in"):
        runner.check(step)
    step.swa_swap_out = np.array([[16, 3]], np.int32)
    with pytest.raises(ValueError, match="sliding swap_out device pages must lie in"):
        runner.check(step)
    step.swa_swap_out = np.array([[1, 3]], np.int32)
    runner.check(step)
