"""The radix replay: a trace driven through the real tree, one lease per request, with requests
overlapping in time and, optionally, a host tier behind the device cache.

**Concurrency.** Each request is admitted at its arrival (first come, first served: never
before the request ahead of it) and holds its lease, its matched path locked and its page table
for prompt + output, until it finishes. A ``ServiceModel`` says how long that is:

    prefill_s = uncached prompt tokens / prefill_tps      (or a live replay's TTFT)
    total_s   = prefill_s + output tokens / decode_tps    (or a live replay's latency)

At ``start + prefill_s`` the lease commits the prompt (the scheduler commits each prefilled
chunk at once, so later requests sharing it hit before this one finishes, and its lock keeps
it cached until then); at ``start + total_s`` the lease is released with prompt + output. A
request that finds no room waits for running ones to finish (as the scheduler's admission
does), and at most ``max_concurrency`` run at once. Like radixserve's scheduler (and
SGLang's), a request whose first ``SHARED_HEAD`` tokens another request is prefilling right now
waits for that prefill when it would otherwise compute a long stretch itself, and then hits it
(``head_wait``; off for engines that do not, such as vLLM). With no service model every
request finishes before the next arrives: the serial replay, a lower bound on eviction
pressure.

The model ignores that a busier server is slower per request (batching); it is about which
pages are locked and which prefixes exist yet, not about latency.

With concurrency a second, unlimited tree follows the same timeline: what the cache *could*
have served at each admission (``visible``). A prefix that an earlier request was still
prefilling is then told apart from one that was evicted.

**Tiers** (``Tiers``), modelled by the engine's own code: a host tier is the tree's own
``HostTier`` (radix/host.py) with the engine's write policy and the same eviction policy as the
device, so a request's match reaches into it and loads from it as the scheduler's does
(``host_cached``: the part of the match found only there). A disk tier (``_Disk``) mirrors
scheduler/disk.py: whole blocks written through as each request's leases commit and release
them, kept least recently used first within its capacity, looked up past the tree's match
from the block that holds its end (``disk_cached``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.contracts.disk_blocks import block_hashes, block_tokens
from engine.profiler.trace import ReplayRequest
from radix import HostTier, Lease, OutOfPages, PageAllocator, RadixTree
from radix.eviction import POLICIES
from radix.sliding import SlidingKV
from scheduler.policy import long_uncached, shared_head

_FINGERPRINT = "00" * 16  # the disk model's block names need one; any will do


class TreeMaker(Protocol):
    """What makes the replay's tree instead of ``_Tree``: sliding-window layers' pools
    (engine/profiler/sliding.py's ``SlidingPools``)."""

    def tree(self, num_pages: int, page_size: int, policy: str, tiers: Tiers,
             service: ServiceModel) -> _Tree: ...


class CacheTooSmall(ValueError):
    """A single request needs more KV pages than the whole cache has."""


@dataclass
class ServiceModel:
    """How long each request runs: rates in tokens/s (None: that phase takes no time), or what
    a live replay measured, by request id: ``(sent_at_s, ttft_s, latency_s)``, the send time
    replacing the trace's arrival."""

    prefill_tps: float | None = None
    decode_tps: float | None = None
    measured: dict[str, tuple[float, float, float]] | None = None
    max_concurrency: int | None = None
    head_wait: bool = True  # hold back a request whose shared head is being prefilled

    @property
    def overlaps(self) -> bool:
        return bool(self.prefill_tps or self.decode_tps or self.measured)

    def describe(self) -> str | None:
        """How requests are timed, for the report (None: serially)."""
        if not self.overlaps:
            return None
        parts = ([f"timings of a live replay for {len(self.measured):,} requests"]
                 if self.measured else [])
        parts += [f"{name} {rate:,.0f} tokens/s" for name, rate in
                  (("prefill", self.prefill_tps), ("decode", self.decode_tps)) if rate]
        if self.max_concurrency:
            parts.append(f"at most {self.max_concurrency} in flight")
        return ", ".join(parts)

    def arrival(self, request: ReplayRequest) -> float:
        if self.measured is not None and request.id in self.measured:
            return self.measured[request.id][0]
        return request.arrival

    def times(self, request: ReplayRequest, uncached: int) -> tuple[float, float]:
        """(prefill seconds, total seconds) for ``request`` with ``uncached`` prompt tokens."""
        if self.measured is not None and request.id in self.measured:
            _, ttft, latency = self.measured[request.id]
            return ttft, max(ttft, latency)
        prefill = uncached / self.prefill_tps if self.prefill_tps else 0.0
        decode = len(request.output) / self.decode_tps if self.decode_tps else 0.0
        return prefill, prefill + decode


@dataclass
class Tiers:
    """The tiers below the device cache, as the engine's ``--host-cache-gb``,
    ``--cache-write-policy`` and ``--disk-cache-dir`` / ``--disk-cache-gb`` make them."""

    host_pages: int = 0
    write_policy: str = "write_back"
    disk_tokens: int = 0


@dataclass
class CacheRun:
    """One cache's per-request results on a trace: this replay's, or a baseline's
    (simulate.py)."""

    label: str
    cached: np.ndarray  # prompt tokens served from cache (the device cache), per request
    capacity_tokens: int | None = None  # None: unlimited
    evicted_tokens: int = 0
    peak_tokens: int = 0  # most KV slots in use at once (running requests included)
    kv_tokens: np.ndarray | None = None  # KV slots held by the cache after each admission
    dropped_matches: int = 0  # requests run uncached because their match left no room
    host_cached: np.ndarray | None = None  # more prompt tokens loaded from a host tier
    disk_cached: np.ndarray | None = None  # more prompt tokens loaded from a disk tier
    visible: np.ndarray | None = None  # an unlimited cache on the same timeline (concurrency)
    waited_s: float = 0.0  # time requests waited for room or a concurrency slot, in total
    peak_running: int = 1  # most requests holding pages at once
    # sliding-window layers' own pool (engine/profiler/sliding.py): its pages, the most in use
    # at once, the kept windows' pages evicted
    sliding: dict[str, int] | None = None

    def hit_rate(self, prompt_tokens: np.ndarray) -> float:
        total = int(prompt_tokens.sum())
        return int(self.cached.sum()) / total if total else 0.0

    def by_tier(self) -> dict[str, np.ndarray]:
        """Cached tokens per request by the tier that served them: the device, then the host
        and disk tiers that exist."""
        tiers = {"device": self.cached, "host": self.host_cached, "disk": self.disk_cached}
        return {name: hits for name, hits in tiers.items() if hits is not None}


def min_pages(requests: list[ReplayRequest], page_size: int) -> int:
    """The smallest cache that can run every request: room for its prompt + output."""
    longest = max(len(r.prompt) + len(r.output) for r in requests)
    return -(-longest // page_size)


class _Tree:
    """A tree and its allocator (and host tier, or sliding-window layers' pages); every request
    goes through a lease."""

    def __init__(self, num_pages: int, page_size: int, policy: str = "lru", host_pages: int = 0,
                 write_policy: str = "write_back", sliding: SlidingKV | None = None,
                 host_windows: int = 0) -> None:
        """``host_windows``: the host tier's pages for its nodes' windows (radix/host.py)."""
        self.alloc = PageAllocator(num_pages, page_size)
        self.host = (HostTier(host_pages, page_size, write_policy, num_sliding_pages=host_windows)
                     if host_pages else None)
        self.tree = RadixTree(self.alloc, eviction_key=POLICIES[policy], host=self.host,
                              sliding=sliding)

    def admit(self, prompt: np.ndarray, namespace: str | None, num_tokens: int,
              max_len: int) -> tuple[Lease, list[int]]:
        """Lease the prompt's cached prefix and a table for ``num_tokens`` (OutOfPages: none)."""
        lease = Lease(self.tree, prompt, namespace, max_len)
        try:
            pages, copy = lease.acquire(num_tokens)
        except OutOfPages:
            lease.unlock()
            raise
        if copy is not None:
            self.alloc.decref([copy.src])  # the copy has run
        self.moved()
        return lease, pages

    def commit(self, lease: Lease, pages: list[int], tokens: np.ndarray) -> None:
        """The prompt's prefill ended: cache it, the lock moving onto it."""
        lease.commit(pages, tokens)

    def release(self, lease: Lease, pages: list[int], tokens: np.ndarray,
                prompt_len: int) -> None:
        """The request ended: cache ``tokens`` (prompt + output) and let go."""
        lease.release(pages, tokens)

    def usage(self) -> dict[str, int] | None:
        """The sliding-window layers' pool use (None: no such pool)."""
        return None

    def moved(self) -> None:
        """The host tier's planned copies have run (nothing to copy in a replay)."""
        if self.host is not None:
            self.host.take_moves()
            self.host.take_window_moves()


class _Disk:
    """The disk tier as scheduler/disk.py runs it, on block names alone: ``capacity`` tokens of
    whole blocks, written through (a block present stays as it is), the least recently loaded
    dropped first."""

    def __init__(self, capacity_tokens: int, page_size: int) -> None:
        self.block = block_tokens(page_size)
        self.capacity = capacity_tokens // self.block
        self.blocks: OrderedDict[str, None] = OrderedDict()

    def lookup(self, tokens: np.ndarray, namespace: str | None, cached: int, limit: int) -> int:
        """Blocks to load past the tree's ``cached`` tokens (``DiskTier.lookup``), touched."""
        first, last = cached // self.block, limit // self.block
        if last * self.block <= cached:
            return 0
        found = 0
        for name in block_hashes(_FINGERPRINT, namespace, tokens[: last * self.block],
                                 self.block, first):
            if name not in self.blocks:
                break
            self.blocks.move_to_end(name)
            found += 1
        return found if (first + found) * self.block > cached else 0

    def store(self, tokens: np.ndarray, namespace: str | None) -> None:
        whole = len(tokens) - len(tokens) % self.block
        for name in block_hashes(_FINGERPRINT, namespace, tokens[:whole], self.block):
            if name not in self.blocks:
                self.blocks[name] = None
                if len(self.blocks) > self.capacity:
                    self.blocks.popitem(last=False)


@dataclass
class _Running:
    lease: Lease
    pages: list[int]
    tokens: np.ndarray  # prompt + output
    prompt_len: int
    loaded: int  # prompt tokens loaded from the disk tier
    shadow: tuple[Lease, list[int]] | None  # its lease on the unlimited tree
    head: tuple | None  # the shared head it is prefilling, that others wait for


_PREFILLED, _FINISHED = 0, 1


class _Replay:
    """One replay's state: the trees, the requests running and their pending events, the
    per-request results. ``serve`` takes the requests one by one, in arrival order."""

    def __init__(self, requests: list[ReplayRequest], num_pages: int, page_size: int,
                 policy: str, service: ServiceModel, tiers: Tiers,
                 sliding: TreeMaker | None = None) -> None:
        self.requests = requests
        self.num_pages = num_pages
        self.service = service
        self.device = (
            _Tree(num_pages, page_size, policy, tiers.host_pages, tiers.write_policy)
            if sliding is None else sliding.tree(num_pages, page_size, policy, tiers, service))
        self.disk = _Disk(tiers.disk_tokens, page_size) if tiers.disk_tokens else None
        self.shadow: _Tree | None = None
        if service.overlaps:
            total = sum(-(-(len(r.prompt) + len(r.output)) // page_size) for r in requests)
            self.shadow = _Tree(total + 1, page_size)
        n = len(requests)
        self.cached = np.zeros(n, dtype=np.int64)
        self.host_cached = np.zeros(n, dtype=np.int64) if tiers.host_pages else None
        self.disk_cached = np.zeros(n, dtype=np.int64) if self.disk else None
        self.visible = np.zeros(n, dtype=np.int64) if self.shadow else None
        self.kv_pages = np.zeros(n, dtype=np.int64)
        self.events: list[tuple[float, int, int, _Running]] = []  # (time, order, kind, run)
        self.order = 0
        self.running = self.peak_running = self.peak_pages = self.dropped = 0
        self.clock = self.waited = 0.0
        self.prefilling: dict[tuple, float] = {}  # shared head -> when its prefill in flight ends

    def serve(self, i: int, r: ReplayRequest) -> None:
        """Admit request ``i`` as soon as it may start, then run it (or schedule its events)."""
        full = np.concatenate([r.prompt, r.output])
        needed, page_size = self.device.alloc.pages_for(len(full)), self.device.alloc.page_size
        if needed > self.num_pages:
            raise CacheTooSmall(
                f"request {r.id!r} needs {needed:,} pages of {page_size} tokens for its prompt "
                f"and output, but the cache has {self.num_pages:,}: give at least "
                f"{min_pages(self.requests, page_size) * page_size:,} cache tokens")
        arrival = self.service.arrival(r)
        head = shared_head(r.prompt, r.namespace, len(r.prompt)) if self.service.head_wait else None
        start = self._start_time(r, max(arrival, self.clock), head)
        run, start = self._admit(r, full, start)
        self.waited += start - arrival
        self.clock = start
        host = run.lease.match.host_length
        self.cached[i] = run.lease.length - host
        if self.host_cached is not None:
            self.host_cached[i] = host
        if self.disk_cached is not None:
            self.disk_cached[i] = run.loaded
        if self.shadow is not None:
            run.shadow = self.shadow.admit(r.prompt, r.namespace, len(full), len(r.prompt) - 1)
            self.visible[i] = run.shadow[0].length
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self.peak_pages = max(self.peak_pages, self._pages_held())
        self._launch(run, r, start, head)
        self.kv_pages[i] = self._pages_held()

    def _start_time(self, r: ReplayRequest, start: float, head: tuple | None) -> float:
        """When ``r`` may start, from ``start`` on: once a concurrency slot is free, and, when
        another request is prefilling its shared head and it would compute a long stretch
        itself, once that prefill is in the tree."""
        self._run_until(start)
        while self.service.max_concurrency and self.running >= self.service.max_concurrency:
            start = max(start, self._next_event())
        while head in self.prefilling and long_uncached(len(r.prompt), self.device.tree.peek_prefix(
                r.prompt, r.namespace, len(r.prompt) - 1)):
            start = max(start, self.prefilling[head])
            self._run_until(start)
        return start

    def _admit(self, r: ReplayRequest, full: np.ndarray, start: float) -> tuple[_Running, float]:
        """Lease ``r``'s prefix and a table for prompt + output, waiting for running requests
        to finish while there is no room; returns the run and when it starts."""
        limit = len(r.prompt) - 1
        while True:
            max_len, loaded = self._disk_lookup(r, limit)
            try:
                lease, pages = self.device.admit(r.prompt, r.namespace, len(full), max_len)
                return _Running(lease, pages, full, len(r.prompt), loaded, None, None), start
            except OutOfPages:
                if self.running:
                    start = max(start, self._next_event())  # wait for room
                    continue
                # The locked match (its partial page, and a page copy at each fork inside a
                # page) leaves too little room in a cache barely bigger than the request: drop
                # the match and run the request uncached, in a cache emptied for it.
                self.device.tree.reset()
                limit = 0
                self.dropped += 1

    def _disk_lookup(self, r: ReplayRequest, limit: int) -> tuple[int, int]:
        """As the scheduler admits: blocks of the disk tier past the tree's match make the
        lease end where the first begins. (The lease's length limit, tokens loaded.)"""
        if self.disk is None or limit <= 0:
            return limit, 0
        cached = self.device.tree.peek_prefix(r.prompt, r.namespace, limit)
        found = self.disk.lookup(r.prompt, r.namespace, cached, limit)
        if not found:
            return limit, 0
        return cached - cached % self.disk.block, found * self.disk.block

    def _launch(self, run: _Running, r: ReplayRequest, start: float, head: tuple | None) -> None:
        """Finish ``run`` now (no service model), or schedule its prefill's end and its end."""
        cached = run.lease.length + run.loaded
        prefill_s, total_s = self.service.times(r, len(r.prompt) - cached)
        if total_s <= 0 or not self.service.overlaps:
            self._finish(run)
            return
        if run.loaded:
            # The engine commits a disk load as soon as it ends (within a step or two), long
            # before the prefill after it: requests sharing it hit the device from then on.
            run.lease.commit(run.pages, run.tokens[:cached])
            self.device.moved()
        if head is not None and long_uncached(len(r.prompt), cached):
            run.head = head
            self.prefilling[head] = max(self.prefilling.get(head, 0.0), start + prefill_s)
        heapq.heappush(self.events, (start + prefill_s, self.order, _PREFILLED, run))
        heapq.heappush(self.events, (start + total_s, self.order + 1, _FINISHED, run))
        self.order += 2

    def _pages_held(self) -> int:
        return self.num_pages - self.device.alloc.num_free_pages

    def _run_until(self, time: float) -> None:
        while self.events and self.events[0][0] <= time:
            self._next_event()

    def _next_event(self) -> float:
        time, _, kind, run = heapq.heappop(self.events)
        if kind == _PREFILLED:
            self._cache(run, run.prompt_len, finished=False)
            if run.head is not None and self.prefilling.get(run.head) == time:
                del self.prefilling[run.head]
        else:
            self._finish(run)
        return time

    def _finish(self, run: _Running) -> None:
        self._cache(run, len(run.tokens), finished=True)
        self.running -= 1

    def _cache(self, run: _Running, num_tokens: int, *, finished: bool) -> None:
        """Cache ``run``'s first ``num_tokens`` in each tree: the leases commit them (a
        prefill's end) or are released with them (the request's end); the disk tier is written
        through."""
        tokens = run.tokens[:num_tokens]
        leases = [(self.device, run.lease, run.pages)] + (
            [(self.shadow, *run.shadow)] if run.shadow is not None else [])
        for tree, lease, pages in leases:
            if finished:
                tree.release(lease, pages, tokens, run.prompt_len)
            else:
                tree.commit(lease, pages, tokens)
        self.device.moved()
        if self.disk is not None:
            self.disk.store(tokens, run.lease.namespace)

    def result(self, label: str) -> CacheRun:
        """Run what is still in flight to its end; the results, the device tree checked."""
        self._run_until(float("inf"))
        self.device.tree.check()
        size = self.device.alloc.page_size
        return CacheRun(label, self.cached, self.num_pages * size,
                        self.device.tree.stats.evicted_pages * size, self.peak_pages * size,
                        self.kv_pages * size, self.dropped, self.host_cached, self.disk_cached,
                        self.visible, self.waited, self.peak_running, self.device.usage())


def replay(requests: list[ReplayRequest], num_pages: int, page_size: int, policy: str = "lru",
           service: ServiceModel | None = None, tiers: Tiers | None = None,
           progress: Iterator[ReplayRequest] | None = None, label: str = "radix",
           sliding: TreeMaker | None = None) -> CacheRun:
    """Replay ``requests`` (in arrival order) through a ``num_pages``-page radix cache (and the
    tiers below it; with ``sliding``, the sliding-window layers' pool beside it)."""
    state = _Replay(requests, num_pages, page_size, policy, service or ServiceModel(),
                    tiers or Tiers(), sliding)
    for i, r in enumerate(progress if progress is not None else requests):
        state.serve(i, r)
    return state.result(label)
