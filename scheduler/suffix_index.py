"""The suffix index: the token runs the radix cache holds, hashed by their short n-grams, so a
decoding sequence finds where its last tokens occurred in other requests' prompts and outputs
and drafts what followed (the ``suffix`` method, scheduler/suffix.py).

The tree tells the index what it caches and drops (it is one of ``RadixTree.listeners``). A
*run* is what one insert added, kept whole across later splits of its node, with up to
``max_depth`` tokens of the path before it as context (a match may start in the parent)::

    path in the tree   [0 ............... cached | what the insert added ......... end)
    the run                 [ context           | own tokens                     )
    entries                                       ^ ^ ^ ^ ...  (continuations start here)

An *entry* is an own position: the ``w`` tokens before it, hashed with the namespace, for each
width ``w`` of ``WIDTHS``, chain it to the previous entry of the same hash, newest first (the
hash chains of LZ77)::

    heads[w][hash] -> newest entry -> links[w][entry] -> older entry -> ... (to the ring's tail)

An eviction shortens the run holding the evicted leaf to where that leaf began (the upper half
of a split, which becomes a leaf in turn, stands for the rest) and drops it when none of its
own tokens are left, so the index never matches a token the tree no longer holds.

Memory, fixed when built: a ring of ``capacity`` slots (a power of two, at most
``MAX_INDEXED_TOKENS``): per slot 4 bytes of token, 8 of run id, and 8 + 8 per width (a
chain head and a link): 60 bytes with three widths, 60 MiB at 2^20 slots (zeroed arrays: the
OS backs only the pages written to). Writing past the ring's end drops the oldest runs; so does a run past
``max_runs``. An evicted run stops matching at once; its slots are reused as the ring wraps.

Lookup, per sequence and step: for each width, longest first, at most ``MAX_CANDIDATES`` chain
steps (a dict lookup each), then one vectorised compare of those candidates against the last
``max_depth`` tokens; the first width with a verified match decides. Past ``MAX_CANDIDATES``
entries of a chain (a common n-gram) only the newest are seen: the bound trades exactness for
a fixed cost, and the newest occurrences are the likeliest to repeat. Namespaces never see each
other's tokens: a candidate's run must be of the asking namespace.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from engine.contracts.speculative import MIN_SUFFIX_MATCH
from radix.node import DEVICE, Node
from radix.tree import RadixTree

WIDTHS = (8, 4, MIN_SUFFIX_MATCH)  # hashed context lengths, longest first
MAX_CANDIDATES = 32  # chain steps per width and lookup
MAX_INDEXED_TOKENS = 1 << 20  # ring slots at most
_PRIME = np.uint64(0x100000001B3)
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class _Run:
    namespace: int  # the index's id of the namespace
    first: int  # ring position (absolute, never wrapped) of its first token, context included
    own: int  # ... of its first own token
    end: int  # ... past its last token the tree still holds
    offset: int  # ring position minus path position
    node: Node  # the lowest tree node holding its own tokens: its eviction shortens the run


class SuffixIndex:
    """Token runs of the radix cache by namespace, hashed for suffix lookups; a tree listener.

    Positions are absolute (the slot is ``position & mask``); 0 means none, so zeroed arrays
    start out empty. A position at or after ``written - capacity`` still holds what was
    written there."""

    def __init__(self, capacity: int, max_runs: int, max_depth: int) -> None:
        capacity = min(max(capacity, 64), MAX_INDEXED_TOKENS)
        self.capacity = 1 << (capacity - 1).bit_length()
        self.mask = self.capacity - 1
        self._shift = np.uint64(64 - (self.capacity.bit_length() - 1))
        self.max_runs = max_runs
        self.max_depth = max_depth
        self.widths = tuple(w for w in WIDTHS if w <= max_depth)
        self.tokens = np.zeros(self.capacity, dtype=np.int32)
        self.run_ids = np.zeros(self.capacity, dtype=np.int64)
        self.heads = np.zeros((len(self.widths), self.capacity), dtype=np.int64)
        self.links = np.zeros((len(self.widths), self.capacity), dtype=np.int64)
        self.written = 1  # the next position written
        self._runs: dict[int, _Run] = {}
        self._order: deque[int] = deque()  # run ids in ring order, oldest first (some dropped)
        self._next_run = 1
        self._by_node: dict[Node, int] = {}
        self._namespaces: dict[Hashable, int] = {}  # namespace -> id, while it has runs
        self._names: dict[int, Hashable] = {}
        self._namespace_runs: dict[int, int] = {}
        self._next_namespace = 1

    @classmethod
    def attached(cls, tree: RadixTree, max_runs: int, max_depth: int) -> SuffixIndex:
        """An index over ``tree`` (empty: what it held so far was never told), with room for
        twice the tokens its pages hold (runs carry context; evicted ones linger in the ring
        until it wraps)."""
        if tree.num_nodes:
            raise RuntimeError("attach the suffix index to an empty tree: what it holds so far "
                               "was never indexed")
        index = cls(2 * tree.allocator.num_pages * tree.page_size, max_runs, max_depth)
        tree.listeners.append(index)
        return index

    @property
    def num_runs(self) -> int:
        return len(self._runs)

    @property
    def indexed_tokens(self) -> int:
        """Tokens of live runs, context included."""
        return sum(run.end - run.first for run in self._runs.values())

    # ------------------------------------------------------------- the tree's listener
    def inserted(self, leaf: Node, key: bytes, cached: int, namespace: Hashable) -> None:
        total = len(key) // 4
        first = max(0, cached - self.max_depth, total - self.capacity)
        own, count = max(cached, first), total - first
        self._make_room(count)
        ns = self._namespace_id(namespace)
        run_id, self._next_run = self._next_run, self._next_run + 1
        start = self.written
        tokens = np.frombuffer(key, dtype=np.int32, count=count, offset=4 * first)
        slots = (start + np.arange(count)) & self.mask
        self.tokens[slots] = tokens
        self.run_ids[slots] = run_id
        self.written += count
        self._runs[run_id] = _Run(ns, start, start + own - first, start + count, start - first,
                                  leaf)
        self._order.append(run_id)
        self._by_node[leaf] = run_id
        self._namespace_runs[ns] += 1
        wide = tokens.astype(np.uint64)
        for i, width in enumerate(self.widths):
            lo = max(own - first, width)  # an entry's width tokens lie inside the run
            if lo < count:
                buckets = self._hashes(wide, width, lo, count, ns)
                self._link(i, start + np.arange(lo, count), buckets)

    def evicted(self, node: Node) -> None:
        run_id = self._by_node.pop(node, None)
        if run_id is None:
            return
        run = self._runs[run_id]
        end = node.start + run.offset
        if end <= run.own:
            self._drop(run_id)
            return
        # What is left of the run lies in the node's parent: an upper half of its splits.
        run.end = min(run.end, end)
        run.node = node.parent
        self._by_node[node.parent] = run_id

    def moved(self, node: Node, tier: str, stored: bool) -> None:
        """A node moving between tiers stays in the tree: its tokens stay draftable."""

    def windows(self, node: Node, index: np.ndarray, kept: bool, tier: str = DEVICE) -> None:
        """Sliding-window KV kept or dropped: the tokens stay in the tree, draftable."""

    def cleared(self) -> None:
        for table in (self._runs, self._order, self._by_node, self._namespaces, self._names,
                      self._namespace_runs):
            table.clear()

    # ------------------------------------------------------------------------ lookup
    def matches(self, context: np.ndarray, namespace: Hashable, k: int) -> tuple[int, np.ndarray]:
        """The longest match (at most ``max_depth`` tokens, at least ``MIN_SUFFIX_MATCH``) of the
        end of ``context`` (int64 token ids) in the runs of ``namespace``, and the next ``k``
        tokens after each of its occurrences (rows, newest first; -1 past a run's end).
        ``(0, no rows)`` when nothing matches."""
        none = np.empty((0, k), dtype=np.int64)
        ns = self._namespaces.get(namespace)
        if ns is None:
            return 0, none
        context = np.asarray(context[-self.max_depth :], dtype=np.int64)
        depth = len(context)
        tail = self.written - self.capacity
        wide = context.astype(np.uint64)
        for i, width in enumerate(self.widths):
            if depth < width:
                continue
            position = int(self.heads[i, int(self._hashes(wide, width, depth, depth + 1, ns)[0])])
            found = []
            for _ in range(MAX_CANDIDATES):
                if position <= 0 or position < tail:
                    break
                slot = position & self.mask
                run = self._runs.get(int(self.run_ids[slot]))
                if run is not None and run.namespace == ns and position < run.end:
                    found.append((position, run.first, run.end))
                position = int(self.links[i, slot])
            if not found:
                continue
            positions, firsts, ends = np.array(found, dtype=np.int64).T
            before = positions[:, None] - np.arange(1, depth + 1)  # nearest first
            same = (before >= firsts[:, None]) & (
                self.tokens[before & self.mask] == context[::-1])
            lengths = np.cumprod(same, axis=1).sum(axis=1)
            best = int(lengths.max())
            if best < width:
                continue  # hash collisions only
            keep = lengths == best
            ahead = positions[keep, None] + np.arange(k)
            return best, np.where(ahead < ends[keep, None],
                                  self.tokens[ahead & self.mask].astype(np.int64), -1)
        return 0, none

    # --------------------------------------------------------------------- internals
    def _hashes(self, tokens: np.ndarray, width: int, lo: int, hi: int, ns: int) -> np.ndarray:
        """The bucket of each entry ``e`` in ``[lo, hi)``: a hash of the namespace and
        ``tokens[e - width : e]`` (uint64)."""
        h = np.full(hi - lo, (ns * _MIX) & _MASK64, dtype=np.uint64)
        for j in range(width):
            h = h * _PRIME + tokens[lo - width + j : hi - width + j]
        return ((h * np.uint64(_MIX)) >> self._shift).astype(np.intp)

    def _link(self, i: int, positions: np.ndarray, buckets: np.ndarray) -> None:
        """Chain ``positions`` (ascending) into their buckets of width ``i``, newest first."""
        order = np.argsort(buckets, kind="stable")
        buckets, positions = buckets[order], positions[order]
        same = buckets[1:] == buckets[:-1]
        previous = self.heads[i, buckets]
        previous[1:] = np.where(same, positions[:-1], previous[1:])
        self.links[i, positions & self.mask] = previous
        newest = np.append(~same, True)
        self.heads[i, buckets[newest]] = positions[newest]

    def _make_room(self, count: int) -> None:
        """Drop the runs the next ``count`` slots overwrite, and the oldest past ``max_runs``."""
        tail = self.written + count - self.capacity
        while self._order:
            run = self._runs.get(self._order[0])
            if run is not None and run.first >= tail and len(self._runs) < self.max_runs:
                break
            run_id = self._order.popleft()
            if run is not None:
                self._drop(run_id)

    def _drop(self, run_id: int) -> None:
        run = self._runs.pop(run_id)
        if self._by_node.get(run.node) == run_id:
            del self._by_node[run.node]
        self._namespace_runs[run.namespace] -= 1
        if not self._namespace_runs[run.namespace]:
            del self._namespace_runs[run.namespace]
            del self._namespaces[self._names.pop(run.namespace)]

    def _namespace_id(self, namespace: Hashable) -> int:
        ns = self._namespaces.get(namespace)
        if ns is None:
            ns = self._namespaces[namespace] = self._next_namespace
            self._names[ns] = namespace
            self._namespace_runs[ns] = 0
            self._next_namespace += 1
        return ns

    # ---------------------------------------------------------------------- checking
    def check(self) -> None:
        """Assert the bookkeeping: every live run's slots are its own and not overwritten,
        each live run is found by its node, the namespace counts, the bounds."""
        assert len(self._runs) <= self.max_runs, f"{len(self._runs)} runs past {self.max_runs}"
        counts: dict[int, int] = {}
        for run_id, run in self._runs.items():
            assert self.written - self.capacity <= run.first <= run.own < run.end, run
            slots = np.arange(run.first, run.end) & self.mask
            assert (self.run_ids[slots] == run_id).all(), f"run {run_id}'s slots were reused"
            assert self._by_node.get(run.node) == run_id, f"run {run_id} lost its node"
            counts[run.namespace] = counts.get(run.namespace, 0) + 1
        assert len(self._by_node) == len(self._runs), "a node maps to a dropped run"
        assert counts == self._namespace_runs, "namespace run counts drifted"
        assert set(self._names) == set(counts) == set(self._namespaces.values())
        assert self.indexed_tokens <= self.capacity
