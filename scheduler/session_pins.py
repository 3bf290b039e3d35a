"""Sessions' pinned KV: after each turn of a multi-turn session, the conversation so far stays
locked in the radix tree for the session's ttl, so the next turn is a full cache hit even when
other traffic would have evicted it.

    open ─▶ turn 1 ends: pin(history 1) ─▶ turn 2 ends: pin(history 2), pin 1 dropped ─▶ ...
                          └─ ttl passed / session closed / pool needed the pages ─▶ plain LRU

A pin is a lease on the history that holds no pages (its lock on the node ending the history pins
the whole path to the root); it is let go on expiry, close, the next pin of the session, or when
a request could not otherwise be admitted. The tokens pinned by all sessions together are bounded: a new
pin past ``max_pinned_tokens`` releases the oldest pins first, and a history longer than the
bound is not pinned at all. Expiries sit in a heap (stale entries skipped), so the scheduler
loop can sleep exactly until the next one.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radix import Lease, RadixTree


@dataclass
class Pin:
    lease: Lease  # holds the lock, no pages
    expires: float


class SessionPins:
    def __init__(self, tree: RadixTree, max_pinned_tokens: int) -> None:
        self.tree = tree
        self.max_pinned_tokens = max_pinned_tokens
        self.ttls: dict[str, float] = {}  # open sessions
        self.parents: dict[str, str] = {}  # a forked session's parent (its history's start)
        self.pins: dict[str, Pin] = {}  # oldest pin first (a re-pin moves to the end)
        self.pinned_tokens = 0
        self._expiries: list[tuple[float, str]] = []

    def open(self, session_id: str, ttl: float, parent: str | None = None) -> None:
        self.ttls[session_id] = ttl
        if parent is not None:
            self.parents[session_id] = parent

    def close(self, session_id: str) -> None:
        self.ttls.pop(session_id, None)
        self.parents.pop(session_id, None)
        self.unpin(session_id)

    def is_open(self, session_id: str) -> bool:
        return session_id in self.ttls

    def pin(self, session_id: str, tokens: Sequence[int], namespace: Hashable,
            now: float) -> None:
        """Pin ``tokens`` (already inserted in the tree) as the session's history."""
        ttl = self.ttls.get(session_id)
        self.unpin(session_id)
        if ttl is None or ttl <= 0 or not tokens or len(tokens) > self.max_pinned_tokens:
            return
        while self.pins and self.pinned_tokens + len(tokens) > self.max_pinned_tokens:
            self.unpin(next(iter(self.pins)))
        # Finding the node to lock is not a request's lookup: keep the hit rate about requests.
        lease = Lease(self.tree, tokens, namespace, count=False)
        if lease.length == 0:
            lease.unlock()
            return
        self.pins[session_id] = Pin(lease, now + ttl)
        self.pinned_tokens += lease.length
        heapq.heappush(self._expiries, (now + ttl, session_id))

    def unpin(self, session_id: str) -> bool:
        pin = self.pins.pop(session_id, None)
        if pin is None:
            return False
        pin.lease.unlock()
        self.pinned_tokens -= pin.lease.length
        return True

    def unpin_oldest(self) -> bool:
        """Release the oldest pin (the pool needs its pages); False when nothing is pinned."""
        return bool(self.pins) and self.unpin(next(iter(self.pins)))

    def expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expires, session_id = heapq.heappop(self._expiries)
            pin = self.pins.get(session_id)
            if pin is not None and pin.expires == expires:
                self.unpin(session_id)

    def seconds_to_next_expiry(self, now: float) -> float | None:
        """How long the scheduler may sleep before a pin expires; None when nothing is pinned."""
        while self._expiries:
            expires, session_id = self._expiries[0]
            pin = self.pins.get(session_id)
            if pin is not None and pin.expires == expires:
                return max(0.0, expires - now)
            heapq.heappop(self._expiries)  # stale: re-pinned, unpinned or closed since
        return None
