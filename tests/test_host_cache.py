"""The prefix cache's host tier (``--host-cache-gb``, radix/host.py) through the real scheduler
and worker in-process (tests/test_scheduler.py's harness: the accounting of both tiers is
checked after every step): KV written down on eviction and loaded back is the KV recompute
gives, token for token against transformers in fp32; prefixes that outgrow the device pool
come back from the host tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.worker.kv_pool import KVPool
from engine.worker.model.config import ModelConfig
from tests.test_scheduler import GREEDY, Harness, hf_greedy, hf_model, model_dir  # noqa: F401


def host_cache_gb(model: str, num_pages: int, page_size: int) -> float:
    """``--host-cache-gb`` that buys exactly ``num_pages`` host pages of the model in fp32
    (a whole number of bytes over 2**30 is exact in a float)."""
    mc = ModelConfig.from_dir(model)
    page_bytes = KVPool.bytes_per_page(num_layers=mc.num_layers, page_size=page_size,
                                       num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                       dtype=torch.float32)
    return num_pages * page_bytes / 2**30


def prompts_with_prefixes(num_prefixes: int, prefix_len: int, seed: int) -> list[list[int]]:
    """One prompt per prefix: the prefix and a short tail of its own (lengths that end inside
    a page)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4000, prefix_len).tolist() + rng.integers(3, 4000, 3 + i % 5).tolist()
            for i in range(num_prefixes)]


def tail_variant(prompt: list[int], seed: int) -> list[int]:
    """The same prompt with a different last few tokens: a match that ends inside a page."""
    rng = np.random.default_rng(seed)
    return prompt[:-3] + rng.integers(3, 4000, 3).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_loaded_from_the_host_tier_gives_the_same_tokens(model_dir, hf_model, page_size):  # noqa: F811
    """Six prompts fill a device pool that holds about two of them; the host tier keeps what is
    evicted. The same prompts again, then variants that diverge inside a page, are served from
    host KV (loaded into fresh pages, the partial page copied): every output equals
    transformers', and the later waves report host hits in ``cached_tokens_host``."""
    pool_tokens = 192
    h = Harness(model_dir, page_size=page_size, num_pages=pool_tokens // page_size,
                host_cache_gb=host_cache_gb(model_dir, 1024 // page_size, page_size),
                chunked_prefill_size=48, max_prefill_tokens=96)
    prompts = prompts_with_prefixes(6, 60, seed=3)
    waves = [prompts, prompts, [tail_variant(p, i) for i, p in enumerate(prompts)]]
    for wave, batch in enumerate(waves):
        for i, p in enumerate(batch):
            h.add(f"w{wave}.{i}", p, GREEDY)
            h.run()  # one at a time: each evicts the oldest prefix from the device
    for wave, batch in enumerate(waves):
        for i, p in enumerate(batch):
            assert h.outputs[f"w{wave}.{i}"][0] == hf_greedy(hf_model, p, 12), (wave, i)
    stats = h.sched.stats()
    assert stats["host_pages_written"] > 0 and stats["host_pages_loaded"] > 0
    for wave in (1, 2):
        finals = [h.finals[f"w{wave}.{i}"][0] for i in range(len(prompts))]
        assert sum(f.cached_tokens_host for f in finals) > 0
        assert all(f.cached_tokens_host <= f.cached_tokens for f in finals)
    assert [h.finals[f"w1.{i}"][0].cached_tokens for i in range(6)] == [
        len(p) - 1 for p in prompts]
    assert h.finals["w0.0"][0].cached_tokens_host == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_hits_with_forks_and_preemption(model_dir, hf_model, mode):  # noqa: F811
    """Greedy forks (n = 2) of prompts served from host KV, in a pool so small that decoding
    preempts (by recompute or by swap, whose host pages are a budget apart from the tier's):
    every sample equals transformers' greedy output."""
    page_size = 4
    h = Harness(model_dir, page_size=page_size, num_pages=32, preemption_mode=mode,
                num_host_pages=64 if mode == "swap" else 0,
                host_cache_gb=host_cache_gb(model_dir, 400, page_size), chunked_prefill_size=32)
    prompts = prompts_with_prefixes(6, 30, seed=5)
    forked = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
    for i, p in enumerate(prompts):
        h.add(f"a{i}", p, GREEDY)
        h.run()
    for i, p in enumerate(prompts):  # all at once: they outgrow the pool while decoding
        h.add(f"b{i}", tail_variant(p, 10 + i), forked)
    h.run()
    assert h.sched.num_preemptions > 0
    assert h.sched.stats()["host_pages_loaded"] > 0
    for i, p in enumerate(prompts):
        expected = hf_greedy(hf_model, tail_variant(p, 10 + i), 40)
        assert h.outputs[f"b{i}"] == {0: expected, 1: expected}, i
    assert len(h.sched.mem.host_free) == h.sched.mem.num_host_pages


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_write_through_policies(model_dir, hf_model, policy):  # noqa: F811
    """write_through copies each prefix down when it is cached, write_through_selective once it
    has been hit twice (here: each prompt asked three times in a row, while the device still
    holds it); either way, once the others have evicted it, it comes back from the host tier
    with the same tokens."""
    page_size = 16
    h = Harness(model_dir, page_size=page_size, num_pages=12, cache_write_policy=policy,
                host_cache_gb=host_cache_gb(model_dir, 64, page_size))
    prompts = prompts_with_prefixes(4, 60, seed=8)
    repeats = 3 if policy == "write_through_selective" else 1
    for i, p in enumerate(prompts):
        for r in range(repeats):
            h.add(f"a{i}.{r}", p, GREEDY)
            h.run()
    for i, p in enumerate(prompts):
        h.add(f"b{i}", p, GREEDY)
        h.run()
    for i, p in enumerate(prompts):
        expected = hf_greedy(hf_model, p, 12)
        assert h.outputs[f"b{i}"][0] == expected
        assert all(h.outputs[f"a{i}.{r}"][0] == expected for r in range(repeats))
    assert h.sched.stats()["host_pages_written"] > 0
    assert sum(h.finals[f"b{i}"][0].cached_tokens_host for i in range(4)) > 0


def cache_hit_rate(model: str, num_pages: int, host_pages: int) -> float:
    """Cached / prompt tokens of a workload whose 12 distinct 100-token prefixes (each asked
    for four times, round-robin) need about 80 pages of 16: the device pool is ``num_pages``."""
    options = {"host_cache_gb": host_cache_gb(model, host_pages, 16)} if host_pages else {}
    h = Harness(model, num_pages=num_pages, **options)
    prompts = prompts_with_prefixes(12, 100, seed=11)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for turn in range(4):
        for i, p in enumerate(prompts):
            h.add(f"{turn}.{i}", tail_variant(p, 100 * turn + i) if turn else p, params)
            h.run()
    finals = [f[0] for f in h.finals.values()]
    return sum(f.cached_tokens for f in finals) / sum(f.prompt_tokens for f in finals)


def test_prefixes_beyond_the_device_pool_come_back_from_the_host_tier(model_dir):  # noqa: F811
    unlimited = cache_hit_rate(model_dir, num_pages=512, host_pages=0)
    device_only = cache_hit_rate(model_dir, num_pages=24, host_pages=0)
    with_host = cache_hit_rate(model_dir, num_pages=24, host_pages=256)
    print(f"cached / prompt tokens: unlimited pool {unlimited:.3f}, 24-page pool "
          f"{device_only:.3f}, 24-page pool + 256 host pages {with_host:.3f}")
    assert device_only < 0.1
    assert with_host >= 0.95 * unlimited


def test_options_tie_the_write_policy_to_a_host_tier(model_dir):  # noqa: F811
    with pytest.raises(ValueError, match="--cache-write-policy write_through needs a host tier"):
        EngineConfig(model=model_dir, cache_write_policy="write_through").validate()
    with pytest.raises(ValueError, match="holds no page"):
        Harness(model_dir, num_pages=16, host_cache_gb=1e-9)
