"""The radix replay: a trace driven through the real tree, one lease per request, with requests
overlapping in time and, optionally, a host tier behind the device cache.

**Concurrency.** Each request is admitted at its arrival (first come, first served: never
before the request ahead of it) and holds its lease, its matched path locked and its page table
for prompt + output, until it finishes. A ``ServiceModel`` says how long that is:

    prefill_s = uncached prompt tokens / prefill_tps      (or a live replay's TTFT)
    total_s   = prefill_s + output tokens / decode_tps    (or a live replay's latency)

At ``start + prefill_s`` the prompt goes into the tree (the scheduler caches each prefilled
chunk at once, so later requests sharing it hit before this one finishes); at ``start +
total_s`` prompt + output go in and the lease is released. A request that finds no room waits
for running ones to finish (as the scheduler's admission does), and at most ``max_concurrency``
run at once. Like radixserve's scheduler (and SGLang's), a request whose first
``SHARED_HEAD`` tokens another request is prefilling right now waits for that prefill when it
would otherwise compute a long stretch itself, and then hits it (``head_wait``; off for
engines that do not, such as vLLM). With no service model every request finishes before the next arrives: the serial
replay, a lower bound on eviction pressure.

The model ignores that a busier server is slower per request (batching); it is about which
pages are locked and which prefixes exist yet, not about latency.

With concurrency a second, unlimited tree follows the same timeline: what the cache *could*
have served at each admission (``visible``). A prefix that an earlier request was still
prefilling is then told apart from one that was evicted.

**Host tier** (``host_pages``): a second, larger tree that every request writes through to
when it is inserted (as SGLang's HiCache does by default), evicting LRU on its own. A request
first matches the device tree, then the host tree: host tokens past the device match are
loaded, not recomputed (``host_cached``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from engine.profiler.policies import POLICIES
from engine.profiler.trace import Request
from radix import Lease, OutOfPages, PageAllocator, RadixTree
from scheduler.policy import long_uncached, shared_head


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

    def arrival(self, request: Request) -> float:
        if self.measured is not None and request.id in self.measured:
            return self.measured[request.id][0]
        return request.arrival

    def times(self, request: Request, uncached: int) -> tuple[float, float]:
        """(prefill seconds, total seconds) for ``request`` with ``uncached`` prompt tokens."""
        if self.measured is not None and request.id in self.measured:
            _, ttft, latency = self.measured[request.id]
            return ttft, max(ttft, latency)
        prefill = uncached / self.prefill_tps if self.prefill_tps else 0.0
        decode = len(request.output) / self.decode_tps if self.decode_tps else 0.0
        return prefill, prefill + decode


@dataclass
class RadixResult:
    cached: np.ndarray  # prompt tokens served by the device cache, per request
    host_cached: np.ndarray | None  # more prompt tokens loaded from the host tier
    visible: np.ndarray | None  # what an unlimited cache on the same timeline served
    evicted_pages: int
    peak_pages: int
    kv_pages: np.ndarray  # pages the cache holds after each admission
    dropped: int  # requests run uncached because their match left no room
    waited_s: float  # total time requests waited for room or a concurrency slot
    peak_running: int


def min_pages(requests: list[Request], page_size: int) -> int:
    """The smallest cache that can run every request: room for its prompt + output."""
    longest = max(len(r.prompt) + len(r.output) for r in requests)
    return -(-longest // page_size)


class _Tree:
    """A tree and its allocator; every request goes through a lease."""

    def __init__(self, num_pages: int, page_size: int, policy: str = "lru") -> None:
        self.alloc = PageAllocator(num_pages, page_size)
        self.tree: RadixTree = POLICIES[policy](self.alloc)

    def admit(self, prompt: np.ndarray, namespace: str | None, num_tokens: int,
              max_len: int) -> tuple[Lease, list[int]]:
        """Lease the prompt's cached prefix and a table for ``num_tokens`` (OutOfPages: none)."""
        lease = self.tree.lease(prompt, namespace, max_len=max_len)
        try:
            pages, copy = lease.acquire(num_tokens)
        except OutOfPages:
            lease.unlock()
            raise
        if copy is not None:
            self.alloc.decref([copy.src])  # the copy has run
        return lease, pages

    def store(self, tokens: np.ndarray, namespace: str | None) -> None:
        """Write ``tokens`` through (the host tier): cached at once, held by nobody; skipped
        when they do not fit even with everything else evicted."""
        try:
            lease, pages = self.admit(tokens, namespace, len(tokens), len(tokens))
        except OutOfPages:
            return
        lease.release(pages, tokens)


@dataclass
class _Running:
    lease: Lease
    pages: list[int]
    tokens: np.ndarray  # prompt + output
    prompt_len: int
    shadow: tuple[Lease, list[int]] | None  # its lease on the unlimited tree
    head: tuple | None  # the shared head it is prefilling, that others wait for


def replay(requests: list[Request], num_pages: int, page_size: int, policy: str = "lru",
           service: ServiceModel | None = None, host_pages: int = 0,
           progress: Iterator[Request] | None = None) -> RadixResult:
    """Replay ``requests`` (in arrival order) through a ``num_pages``-page radix cache."""
    service = service or ServiceModel()
    overlaps = service.overlaps
    device = _Tree(num_pages, page_size, policy)
    host = _Tree(host_pages, page_size) if host_pages else None
    shadow = None
    if overlaps:
        total = sum(-(-(len(r.prompt) + len(r.output)) // page_size) for r in requests)
        shadow = _Tree(total + 1, page_size)
    n = len(requests)
    cached = np.zeros(n, dtype=np.int64)
    host_cached = np.zeros(n, dtype=np.int64) if host else None
    visible = np.zeros(n, dtype=np.int64) if shadow else None
    kv_pages = np.zeros(n, dtype=np.int64)
    events: list[tuple[float, int, int, _Running]] = []  # (time, order, kind, run)
    order = 0
    running = peak_running = peak_pages = dropped = 0
    clock = waited = 0.0
    prefilling: dict[tuple, float] = {}  # shared head -> when its prefill in flight ends

    def insert(run: _Running, num_tokens: int) -> None:
        tokens = run.tokens[:num_tokens]
        device.tree.insert(tokens, run.pages, run.lease.namespace)
        if run.shadow is not None:
            shadow.tree.insert(tokens, run.shadow[1], run.lease.namespace)
        if host is not None:
            host.store(tokens, run.lease.namespace)

    def finish(run: _Running) -> None:
        nonlocal running
        insert(run, len(run.tokens))
        run.lease.release(run.pages)
        if run.shadow is not None:
            run.shadow[0].release(run.shadow[1])
        running -= 1

    def next_event() -> float:
        time, _, kind, run = heapq.heappop(events)
        if kind == _PREFILLED:
            insert(run, run.prompt_len)
            if run.head is not None and prefilling.get(run.head) == time:
                del prefilling[run.head]
        else:
            finish(run)
        return time

    for i, r in enumerate(progress if progress is not None else requests):
        full = np.concatenate([r.prompt, r.output])
        needed = device.alloc.pages_for(len(full))
        if needed > num_pages:
            raise CacheTooSmall(
                f"request {r.id!r} needs {needed:,} pages of {page_size} tokens for its prompt "
                f"and output, but the cache has {num_pages:,}: give at least "
                f"{min_pages(requests, page_size) * page_size:,} cache tokens")
        arrival = service.arrival(r)
        start = max(arrival, clock)
        while events and events[0][0] <= start:
            next_event()
        while service.max_concurrency and running >= service.max_concurrency:
            start = max(start, next_event())
        head = shared_head(r.prompt, r.namespace, len(r.prompt)) if service.head_wait else None
        while head in prefilling and long_uncached(len(r.prompt), device.tree.peek_prefix(
                r.prompt, r.namespace, len(r.prompt) - 1)):
            start = max(start, prefilling[head])
            while events and events[0][0] <= start:
                next_event()
        max_len = len(r.prompt) - 1
        while True:
            try:
                lease, pages = device.admit(r.prompt, r.namespace, len(full), max_len)
                break
            except OutOfPages:
                if running:
                    start = max(start, next_event())  # wait for room
                    continue
                # The locked match (its partial page, and a page copy at each fork inside a
                # page) leaves too little room in a cache barely bigger than the request: drop
                # the match and run the request uncached, in a cache emptied for it.
                device.tree.reset()
                max_len = 0
                dropped += 1
        waited += start - arrival
        clock = start
        cached[i] = lease.length
        run = _Running(lease, pages, full, len(r.prompt), None, None)
        if shadow is not None:
            run.shadow = shadow.admit(r.prompt, r.namespace, len(full), len(r.prompt) - 1)
            visible[i] = run.shadow[0].length
        if host is not None:
            found = host.tree.match_prefix(r.prompt, r.namespace, max_len=len(r.prompt) - 1)
            host_cached[i] = max(0, found.length - lease.length)
        running += 1
        peak_running = max(peak_running, running)
        peak_pages = max(peak_pages, num_pages - device.alloc.num_free_pages)
        prefill_s, total_s = service.times(r, len(r.prompt) - lease.length)
        if total_s <= 0 or not overlaps:
            finish(run)
        else:
            if head is not None and long_uncached(len(r.prompt), lease.length):
                run.head = head
                prefilling[head] = max(prefilling.get(head, 0.0), start + prefill_s)
            heapq.heappush(events, (start + prefill_s, order, _PREFILLED, run))
            heapq.heappush(events, (start + total_s, order + 1, _FINISHED, run))
            order += 2
        kv_pages[i] = num_pages - device.alloc.num_free_pages
    while events:
        next_event()
    device.tree.check()
    return RadixResult(cached, host_cached, visible, device.tree.stats.evicted_pages,
                       peak_pages, kv_pages, dropped, waited, peak_running)


_PREFILLED, _FINISHED = 0, 1
