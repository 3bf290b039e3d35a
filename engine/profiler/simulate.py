"""Offline replay of a trace through the real radix tree, and through the baselines beside it.

Every request is driven through a lease (radix/lease.py), the way the scheduler drives the
tree::

    lease at most len(prompt) - 1 tokens (match, lock)
    acquire pages for prompt + output, evicting unlocked leaves when short
      (a match ending inside a page shares the full pages and gets a fresh page for the copy)
    (with a service model: commit the prompt when its prefill ends: insert it, lock it)
    release with prompt + output (insert, unlock, drop the request's own page references)

No model runs: outputs come from the trace. By default requests run one at a time in arrival
order, so a request never holds pages while another is admitted and eviction pressure is a
lower bound on a busy server's; a ``ServiceModel`` makes them overlap, and ``Tiers`` adds a
host and a disk tier below the device cache (engine/profiler/replay.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from engine.profiler.baselines import BLOCK_SIZE, BlockChains, BlockHashCache
from engine.profiler.kv_bytes import KVBytes
from engine.profiler.replay import CacheRun, ServiceModel, Tiers, min_pages, replay
from engine.profiler.sliding import SlidingPools
from engine.profiler.trace import ReplayRequest

# Below this many requests a replay finishes before a progress bar is worth drawing.
PROGRESS_MIN_REQUESTS = 2000


def _progress(requests: list[ReplayRequest], label: str, progress: bool) -> Iterator[ReplayRequest]:
    show = progress and len(requests) >= PROGRESS_MIN_REQUESTS
    return iter(tqdm(requests, desc=label, unit="req", leave=False, disable=not show))


def replay_radix(requests: list[ReplayRequest], num_pages: int, page_size: int,
                 policy: str = "lru", label: str = "radix", progress: bool = False,
                 service: ServiceModel | None = None, tiers: Tiers | None = None,
                 sliding: SlidingPools | None = None) -> CacheRun:
    """Replay through ``RadixTree`` (evicting by ``policy``, radix/eviction.py) with ``num_pages``
    pages (and ``sliding``'s pool beside them)."""
    return replay(requests, num_pages, page_size, policy, service, tiers,
                  _progress(requests, label, progress), label, sliding)


def replay_unlimited(requests: list[ReplayRequest], page_size: int,
                     progress: bool = False) -> CacheRun:
    """The radix tree with room for every request's pages at once: it never evicts."""
    num_pages = sum(-(-(len(r.prompt) + len(r.output)) // page_size) for r in requests) + 1
    run = replay_radix(requests, num_pages, page_size, label="unlimited", progress=progress)
    run.capacity_tokens = None
    return run


def replay_block_hash(requests: list[ReplayRequest], num_blocks: int | None,
                      block_size: int = BLOCK_SIZE, label: str = "block hash",
                      progress: bool = False, chains: BlockChains | None = None) -> CacheRun:
    """Replay through ``BlockHashCache``; ``chains`` (``BlockChains.of(requests,
    block_size)``) lets several capacities share one hashing of the trace."""
    if chains is None:
        chains = BlockChains.of(requests, block_size)
    cache = BlockHashCache(num_blocks, block_size)
    cached = np.zeros(len(requests), dtype=np.int64)
    kv_tokens = np.zeros(len(requests), dtype=np.int64)
    for i, _ in enumerate(_progress(requests, label, progress)):
        cached[i] = cache.serve_chain(chains, i)
        kv_tokens[i] = cache.num_cached_blocks * block_size
    capacity = None if num_blocks is None else num_blocks * block_size
    return CacheRun(label, cached, capacity, cache.evicted_blocks * block_size,
                    cache.peak_blocks * block_size, kv_tokens)


@dataclass
class Profile:
    """A trace replayed through the configured cache and every baseline."""

    requests: list[ReplayRequest]
    page_size: int
    num_pages: int
    policy: str
    radix: CacheRun
    unlimited: CacheRun
    block: CacheRun
    block_unlimited: CacheRun
    tiers: Tiers | None = None  # the tiers below the radix cache, as replayed
    # with sliding-window layers' pool (``radix`` replays it): full KV in the same memory
    sliding: SlidingPools | None = None
    full_kv: CacheRun | None = None

    @property
    def prompt_tokens(self) -> np.ndarray:
        return np.array([len(r.prompt) for r in self.requests], dtype=np.int64)

    @property
    def arrivals(self) -> np.ndarray:
        return np.array([r.arrival for r in self.requests], dtype=np.float64)

    @property
    def runs(self) -> list[CacheRun]:
        none = CacheRun("no cache", np.zeros(len(self.requests), dtype=np.int64), 0)
        return [self.radix, self.unlimited, self.block, self.block_unlimited, none] + (
            [self.full_kv] if self.full_kv is not None else [])


def run_profile(requests: list[ReplayRequest], num_pages: int, page_size: int, policy: str = "lru",
                progress: bool = False, service: ServiceModel | None = None,
                tiers: Tiers | None = None, sliding: SlidingPools | None = None) -> Profile:
    """The configured radix cache (with ``service``'s concurrency and the tiers if given, or
    ``sliding``'s pool beside it and then full KV in the same memory, tiers too), the same capacity
    in 16-token hash blocks, and both without a capacity limit, serially (the upper bounds of
    token and of block matching)."""
    label = f"radix p{page_size} {policy}"
    full_kv = None
    if sliding is not None:
        full_kv = replay_radix(requests, sliding.full_kv_pages(num_pages), page_size, policy,
                               f"{label} full KV, same memory", progress,
                               tiers=sliding.full_kv_tiers(tiers))
        label += f" sliding {sliding.ratio:g}"
    radix = replay_radix(requests, num_pages, page_size, policy, label, progress, service,
                         tiers, sliding)
    unlimited = replay_unlimited(requests, page_size, progress)
    chains = BlockChains.of(requests)
    block = replay_block_hash(requests, max(1, num_pages * page_size // BLOCK_SIZE),
                              label=f"block hash {BLOCK_SIZE}", progress=progress, chains=chains)
    block_unlimited = replay_block_hash(requests, None, label=f"block hash {BLOCK_SIZE} unlimited",
                                        progress=progress, chains=chains)
    return Profile(requests, page_size, num_pages, policy, radix, unlimited, block,
                   block_unlimited, tiers, sliding, full_kv)


@dataclass
class SweepPoint:
    cache_tokens: int
    radix_hit_rate: float
    block_hit_rate: float
    radix_evicted_tokens: int
    cache_bytes: int | None = None  # None: the bytes of a token are not known
    # What 8-bit KV buys: per KV dtype (the model's own and int8), the tokens ``cache_bytes``
    # hold in it and the radix hit rate there (None: too few for the longest request).
    by_kv_dtype: dict[str, tuple[int, float | None]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """One flat row (sweep.csv and summary.json): ``<dtype>_tokens``, ``<dtype>_hit_rate``
        per compared KV dtype."""
        row: dict[str, Any] = {"cache_tokens": self.cache_tokens, "cache_bytes": self.cache_bytes,
                               "radix_hit_rate": self.radix_hit_rate,
                               "block_hit_rate": self.block_hit_rate,
                               "radix_evicted_tokens": self.radix_evicted_tokens}
        for dtype, (tokens, hit_rate) in self.by_kv_dtype.items():
            row[f"{dtype}_tokens"], row[f"{dtype}_hit_rate"] = tokens, hit_rate
        return row


def sweep_sizes(requests: list[ReplayRequest], page_size: int, footprint_tokens: int,
                points: int = 8) -> list[int]:
    """Cache sizes in tokens, geometric from 1/32 of the trace's footprint (at least twice the
    longest request) up to the footprint, where nothing is evicted any more."""
    # Below twice the longest request, locked matches start crowding out the new pages.
    smallest = 2 * min_pages(requests, page_size)
    largest = max(smallest, -(-footprint_tokens // page_size))
    lowest = max(smallest, largest // 32)
    pages = np.unique(np.geomspace(lowest, largest, points).round().astype(np.int64))
    return [int(p) * page_size for p in pages]


def run_sweep(requests: list[ReplayRequest], sizes_tokens: list[int], page_size: int,
              policy: str = "lru", progress: bool = False,
              service: ServiceModel | None = None, kv: KVBytes | None = None) -> list[SweepPoint]:
    """The radix cache and block hashing at each size; with ``kv``, each size in bytes too,
    and with a model's shape the radix cache again at the tokens those bytes hold in the
    model's dtype and in int8 (a size given in one of them is not replayed twice)."""
    prompt_tokens = np.array([len(r.prompt) for r in requests], dtype=np.int64)
    chains = BlockChains.of(requests)
    smallest = min_pages(requests, page_size)
    compared = kv.compared() if kv is not None else {}
    points = []
    for size in tqdm(sizes_tokens, desc="sweep", unit="size", leave=False,
                     disable=not progress or len(requests) < PROGRESS_MIN_REQUESTS):
        num_pages = max(1, size // page_size)
        radix = replay_radix(requests, num_pages, page_size, policy, service=service)
        block = replay_block_hash(requests, max(1, size // BLOCK_SIZE), chains=chains)
        point = SweepPoint(size, radix.hit_rate(prompt_tokens), block.hit_rate(prompt_tokens),
                           radix.evicted_tokens)
        if kv is not None:
            point.cache_bytes = size * kv.bytes_per_token
        for dtype, bytes_per_token in compared.items():
            pages = point.cache_bytes // (bytes_per_token * page_size)
            if pages == num_pages:
                hit_rate: float | None = point.radix_hit_rate
            elif pages < smallest:
                hit_rate = None
            else:
                hit_rate = replay_radix(requests, pages, page_size, policy,
                                        service=service).hit_rate(prompt_tokens)
            point.by_kv_dtype[dtype] = (pages * page_size, hit_rate)
        points.append(point)
    return points
