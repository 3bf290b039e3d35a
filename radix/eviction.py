"""Eviction policies as key functions: which unlocked leaf the tree evicts first.

The tree keeps one integer per node, ``Node.eviction_key``, and evicts the unlocked leaf with the
smallest key first (a heap; an entry whose node was touched since it was queued is requeued at
its new key). On each touch the key of every node on the touched path is recomputed by the
tree's ``eviction_key`` function from the node's previous key, the tree's clock (one tick per
touch) and whether the touch was a *use* (a match: a holder reached the node) or a write (an
insert: prompt + output cached, which refreshes recency but reuses nothing)::

    key = eviction_key(previous, clock, used)

``lru``: the clock alone, least recently touched first. ``slru`` (segmented LRU): a node no
match has reached since it was cached (the probationary segment) goes before any that one has
(the protected segment), least recently touched first within each; a one-off prompt then
never flushes a prefix that was reused, while recency still orders everything else. ``lfu``: ``uses * _USE + clock``, least
frequently used first, least recently touched among equals: LFU without aging. A freshly cached
branch that nobody has reused is the first to go (LFU's defence against one-off prompts
flushing shared prefixes), and a prefix that was hot long ago stays (its weakness when
yesterday's hot prefix is never asked for again).
"""

from __future__ import annotations

from collections.abc import Callable

from radix.node import Node

EvictionKey = Callable[[int, int, bool], int]

# Recency occupies the low bits: ``key = uses * _USE + clock``. Python integers do not overflow,
# and one process runs far fewer than 2**48 tree operations.
_USE = 1 << 48


def lru(previous: int, clock: int, used: bool) -> int:
    """Least recently used first."""
    return clock


def lfu(previous: int, clock: int, used: bool) -> int:
    """Least frequently used first (uses counted by matches, not inserts), then least recent."""
    return (previous // _USE + used) * _USE + clock


def slru(previous: int, clock: int, used: bool) -> int:
    """Never matched since cached first (probationary), then matched (protected); least
    recently touched first within each."""
    return (bool(previous // _USE) or used) * _USE + clock


def uses(node: Node) -> int:
    """How many matches reached ``node`` under ``lfu`` (for tests and reports)."""
    return node.eviction_key // _USE


POLICIES: dict[str, EvictionKey] = {"lru": lru, "lfu": lfu, "slru": slru}
