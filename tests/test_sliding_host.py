"""The host tier (``--host-cache-gb``) with sliding-window layers in pages of their own
(``--sliding-kv-ratio``), served in-process on the small Gemma-3-shaped model of
tests/test_sliding_kv.py (a 16-token window), at page sizes 1 and 16.

A node leaves the device with the windows it keeps (host sliding pages beside its host pages,
paid from the same budget), so a match may reach through host-only nodes to where a prompt or a
turn ended: prompts evicted to the host tier and resent, and a next turn after its history went
to the host tier, hit in full and decode transformers' greedy tokens. The accounting of the four
pools (device and host, full and sliding) holds after every step, and nothing leaks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.contracts.protocol import SchedulerStats
from engine.contracts.sampling_params import SamplingParams
from engine.server.metrics import _sliding_pages
from engine.worker.kv_pool import KVPool
from engine.worker.model.config import ModelConfig
from tests.test_scheduler import hf_greedy
from tests.test_sliding_kv import WindowHarness, gemma_dir, hf_gemma, prompts  # noqa: F401

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
RATIO = 0.75  # enough sliding pages for the windows of the two prompts the pool holds


def host_cache_gb(model: str, num_pages: int, page_size: int, ratio: float = RATIO) -> float:
    """``--host-cache-gb`` that buys ``num_pages`` host pages in fp32, each with its
    ``ratio`` share of a sliding page (two sliding layers, one full)."""
    mc = ModelConfig.from_dir(model)
    full, sliding = (KVPool.bytes_per_page(num_layers=n, page_size=page_size,
                                           num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                           dtype=torch.float32) for n in (1, 2))
    return num_pages * (full + math.ceil(ratio * sliding)) / 2**30


@pytest.mark.parametrize(("page_size", "policy", "ratio"), [
    (1, "write_back", RATIO), (16, "write_back", RATIO),
    # fewer sliding pages than the device's cached windows need: they go to the host copies
    # that write-through made, before the device drops them
    (16, "write_through", 0.5)])
def test_windows_go_to_the_host_tier_and_come_back(gemma_dir, hf_gemma, page_size,  # noqa: F811
                                                   policy, ratio):
    """Six prompts through a device pool that holds about two: each evicts the oldest to the
    host tier with its windows. Resent, each hits all but its last token (host hits for those
    evicted); the first one's next turn, after its history went to the host tier again, hits
    its whole history; every output equals transformers'."""
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=320 // page_size,
                      sliding_kv_ratio=ratio, chunked_prefill_size=24, max_prefill_tokens=64,
                      host_cache_gb=host_cache_gb(gemma_dir, 2048 // page_size, page_size,
                                                  ratio),
                      cache_write_policy=policy)
    tree = h.sched.tree
    host_windows = int(ratio * 2048) // page_size
    assert tree.host.swa is not None and tree.host.swa.num_pages == host_windows
    assert h.worker.runner.pool.host_swa.shape[2] == h.config.num_host_pages + host_windows
    cold = prompts(6, seed=11)
    for wave in "ab":  # cold, then resent
        for i, p in enumerate(cold):
            h.add(f"{wave}{i}", p, GREEDY)
            h.run()  # one at a time: each pushes the oldest off the device
    for i, p in enumerate(cold):
        expected = hf_greedy(hf_gemma, p, 20)
        assert h.outputs[f"a{i}"][0] == expected and h.outputs[f"b{i}"][0] == expected, i
        assert h.finals[f"b{i}"][0].cached_tokens == len(p) - 1, i
    # the first prompts were evicted before their resend: read back from the host tier
    assert h.finals["b0"][0].cached_tokens_host > 0
    assert h.finals["b1"][0].cached_tokens_host > 0
    stats = h.sched.stats()
    assert stats["host_pages_written"] > 0 and stats["host_pages_loaded"] > 0
    assert stats["host_cache_sliding_pages_total"] == host_windows
    assert 0 < stats["host_cache_sliding_pages_used"] <= host_windows
    turn = cold[0] + h.outputs["a0"][0] + [5, 6, 7]
    h.add("turn", turn, GREEDY)
    h.run()
    assert h.finals["turn"][0].cached_tokens == len(cold[0]) + 19
    assert h.finals["turn"][0].cached_tokens_host > 0
    assert h.outputs["turn"][0] == hf_greedy(hf_gemma, turn, 20)
    tree.reset()  # nothing runs: every pool is free again
    for alloc in (tree.allocator, tree.sliding.allocator, tree.host.allocator, tree.host.swa):
        assert alloc.num_free_pages == alloc.num_pages


def test_a_host_tier_without_room_for_windows_holds_no_match_past_them(gemma_dir):  # noqa: F811
    """A ratio whose share of the host tier rounds to no sliding page: nodes leave the device
    without windows, so no match reaches into the host part (it would read sliding KV nobody
    has), and the tokens are recomputed."""
    h = WindowHarness(gemma_dir, page_size=16, num_pages=20, sliding_kv_ratio=RATIO,
                      chunked_prefill_size=24, max_prefill_tokens=64,
                      host_cache_gb=host_cache_gb(gemma_dir, 1, 16))
    assert h.sched.tree.host.swa is None
    cold = prompts(3, seed=12)
    for wave in "ab":
        for i, p in enumerate(cold):
            h.add(f"{wave}{i}", p, GREEDY)
            h.run()
    for i in range(3):
        assert h.outputs[f"b{i}"][0] == h.outputs[f"a{i}"][0]
        assert h.finals[f"b{i}"][0].cached_tokens_host == 0


@pytest.mark.parametrize(("page_size", "ratio"), [(1, 0.3), (16, 0.5)])
def test_a_prompt_longer_than_the_sliding_pool_comes_back_from_the_host_tier(
        gemma_dir, hf_gemma, page_size, ratio):  # noqa: F811
    """Loading a match from the host tier takes sliding pages for the window before its end
    only, not for every loaded page: a 200-token prompt pushed to the host tier by another
    comes back through a sliding pool smaller than it, hitting all but its last token."""
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=320 // page_size,
                      sliding_kv_ratio=ratio, chunked_prefill_size=24, max_prefill_tokens=64,
                      host_cache_gb=host_cache_gb(gemma_dir, 1024 // page_size, page_size,
                                                  ratio))
    assert h.sched.tree.sliding.allocator.num_pages * page_size < 200
    rng = np.random.default_rng(13)
    first, other = (rng.integers(3, 90, 200).tolist() for _ in range(2))
    for rid, p in (("a", first), ("b", other), ("again", first)):
        h.add(rid, p, GREEDY)
        h.run()
    final = h.finals["again"][0]
    assert final.cached_tokens == 199 and final.cached_tokens_host > 0
    expected = hf_greedy(hf_gemma, first, 20)
    assert h.outputs["a"][0] == h.outputs["again"][0] == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_beside_the_host_tier_keeps_the_tokens(gemma_dir, hf_gemma, mode):  # noqa: F811
    """A load that preempts (swap pages are a budget apart from the tier's, in both host
    pools), in waves that send prompts back through the host tier: every output equals
    transformers', and every pool is free at the end."""
    page_size = 16
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=20, sliding_kv_ratio=0.5,
                      chunked_prefill_size=24, max_prefill_tokens=48, preemption_mode=mode,
                      num_host_pages=32, host_cache_gb=host_cache_gb(gemma_dir, 64, page_size))
    wave = prompts(6, seed=14)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for name in "ab":
        for i, p in enumerate(wave):
            h.add(f"{name}{i}", p, params)
        h.run()
    assert h.sched.num_preemptions > 0
    assert sum(h.finals[f"b{i}"][0].cached_tokens_host for i in range(6)) > 0
    for i, p in enumerate(wave):
        expected = hf_greedy(hf_gemma, p, 40)
        assert h.outputs[f"a{i}"][0] == h.outputs[f"b{i}"][0] == expected, i
    tree = h.sched.tree
    tree.reset()
    for alloc in (tree.allocator, tree.sliding.allocator, tree.host.allocator, tree.host.swa):
        assert alloc.num_free_pages == alloc.num_pages
    assert len(h.sched.mem.host_free) == 32


@pytest.mark.parametrize(("page_size", "policy"), [
    (1, "write_back"), (16, "write_back"), (16, "write_through")])
def test_a_window_the_sliding_pool_evicted_comes_back_from_the_host_tier(
        gemma_dir, hf_gemma, page_size, policy):  # noqa: F811
    """A device pool that holds every prompt beside a sliding pool that keeps few windows: the
    sliding pool evicts the first prompts' windows while their full KV stays on the device,
    and they go to the host tier (under write_back with a host copy of their nodes made then).
    Resent, each prompt hits all but its last token on the device, the windows the sliding
    pool let go are loaded back from the host tier, and every output equals transformers'."""
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=1280 // page_size,
                      sliding_kv_ratio=0.1, chunked_prefill_size=24, max_prefill_tokens=64,
                      host_cache_gb=host_cache_gb(gemma_dir, 5120 // page_size, page_size, 0.1),
                      cache_write_policy=policy)
    tree = h.sched.tree
    assert tree.host.swa.num_pages * page_size >= 512  # room for every prompt's window
    cold = prompts(5, seed=15)
    for wave in "ab":  # cold, then resent
        for i, p in enumerate(cold):
            h.add(f"{wave}{i}", p, GREEDY)
            h.run()
        if wave == "a":
            assert tree.stats.evicted_pages == 0  # every prompt's full KV stayed
            assert tree.stats.sliding_evicted_pages > 0
    assert tree.stats.sliding_loaded_pages > 0
    # and /metrics counts them
    stats = SchedulerStats(**{k: v for k, v in h.sched.stats().items()
                              if k in SchedulerStats.__struct_fields__})
    loaded = {m.name: m.samples[0].value for m in _sliding_pages(stats)}
    assert loaded["radixserve_sliding_kv_loaded_pages"] == tree.stats.sliding_loaded_pages
    for i, p in enumerate(cold):
        expected = hf_greedy(hf_gemma, p, 20)
        assert h.outputs[f"a{i}"][0] == h.outputs[f"b{i}"][0] == expected, i
        assert h.finals[f"b{i}"][0].cached_tokens == len(p) - 1, i
        assert h.finals[f"b{i}"][0].cached_tokens_host == 0, i
    tree.reset()
    for alloc in (tree.allocator, tree.sliding.allocator, tree.host.allocator, tree.host.swa):
        assert alloc.num_free_pages == alloc.num_pages
