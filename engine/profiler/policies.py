"""Eviction policies for the profiler's what-if runs, on top of the unchanged radix tree.

``RadixTree`` evicts the unlocked leaf with the smallest ``Node.last_access`` (a heap, with
entries requeued when a node was touched after being queued). Its default stamps that field
with a clock, which is LRU. ``LfuRadixTree`` stamps it with ``(uses, clock)`` folded into one
integer instead, so the same heap evicts the least frequently used leaf first, the least
recently used among equals: LFU without aging (a prefix that was hot long ago stays).

A node's *uses* count the requests whose match reached it. Inserting a request's
prompt + output refreshes recency but is not a use, so a freshly inserted branch that nobody has
reused yet is the first to go: that is LFU's defence against one-off prompts flushing shared
prefixes, and its weakness when yesterday's hot prefix is never asked for again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from radix import Node, PageAllocator, RadixTree

# Recency occupies the low bits: ``last_access = uses * _USE + clock``. Python integers do not
# overflow, and one process replays far fewer than 2**48 tree operations.
_USE = 1 << 48


class LfuRadixTree(RadixTree):
    """A radix tree that evicts the least frequently used unlocked leaf first."""

    def __init__(self, allocator: PageAllocator) -> None:
        super().__init__(allocator)
        self._counting_use = True

    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int] | np.ndarray,
               namespace: Hashable = None) -> int:
        self._counting_use = False
        try:
            return super().insert(tokens, pages, namespace)
        finally:
            self._counting_use = True

    def _touch(self, node: Node) -> None:
        self._clock += 1
        bump = _USE if self._counting_use else 0
        while node.parent is not None:
            node.last_access = (node.last_access // _USE) * _USE + bump + self._clock
            node = node.parent


POLICIES: dict[str, type[RadixTree]] = {"lru": RadixTree, "lfu": LfuRadixTree}


def uses(node: Node) -> int:
    """How many matches reached ``node`` under ``LfuRadixTree`` (for tests and reports)."""
    return node.last_access // _USE
